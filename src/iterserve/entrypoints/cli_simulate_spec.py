"""`iterserve simulate --speculative-config ...`: speculative decoding in the simulator.

    iterserve simulate --model llama-2-7b --hardware h100 --output-len fixed:256 \\
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "adaptive": false}' \\
        --spec-acceptance '{"rate": 0.7}' --spec-break-even auto

``--speculative-config`` is serve's flag (the same JSON); ``--spec-acceptance`` says how
often the workload's drafts are right (``sim/speculative.py``: a constant rate,
per-position rates, a mean acceptance length, or the counters vLLM's
``spec_decode_*`` metrics report); ``--spec-break-even`` simulates each request rate
without and with speculation and prints the rate at which it stops paying.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from iterserve.config import SpeculativeConfig
from iterserve.sim.speculative import AcceptanceModel


def add_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--spec-acceptance", default=None, metavar="JSON",
        help="with --speculative-config: how often drafts are accepted, e.g. '{\"rate\": 0.7}', "
             "'{\"per_position\": [0.8, 0.6, 0.5]}', '{\"mean_acceptance_length\": 2.4}' or "
             "vLLM's counters '{\"num_drafts\": N, \"accepted_per_pos\": [...]}'; "
             "optional: 'draft_prob' (share of steps with a draft), 'draft_step_s' and "
             "'draft_token_s' (a draft model's own time per draft step and per token)")
    group.add_argument(
        "--spec-break-even", default=None, metavar="RATES",
        help="with --speculative-config: request rates (comma list, req/s) or 'auto' "
             "(0.05..1.0 of the predicted capacity), each simulated without and with "
             "speculation: TPOT p50 of both and the rate where speculation stops paying")


def acceptance_for(args: argparse.Namespace,
                   spec: SpeculativeConfig | None) -> AcceptanceModel | None:
    """The acceptance model the flags give (None without speculation); exits on errors."""
    if spec is None:
        if args.spec_acceptance or args.spec_break_even:
            raise SystemExit("error: --spec-acceptance / --spec-break-even need "
                             "--speculative-config")
        return None
    if not args.spec_acceptance:
        raise SystemExit("error: --speculative-config in a simulation needs --spec-acceptance "
                         "(how often the workload's drafts are accepted)")
    try:
        return AcceptanceModel.parse(args.spec_acceptance, spec.num_speculative_tokens)
    except ValueError as e:
        raise SystemExit(f"error: --spec-acceptance: {e}") from None


def run_break_even(
    args: argparse.Namespace,
    workload_at: Callable[[float], Any],
    capacity_rps: float,
    scheduler_config: Any,
    cache_config: Any,
    cost: Any,
    spec: SpeculativeConfig,
    acceptance: AcceptanceModel,
    out_dir: Path | None,
) -> int:
    from iterserve.sim.speculative import break_even, format_points, sweep_loads

    if args.spec_break_even == "auto":
        rates = [round(f * capacity_rps, 4) for f in (0.05, 0.1, 0.2, 0.35, 0.5, 0.7, 0.85, 1.0)]
    else:
        try:
            rates = [float(x) for x in args.spec_break_even.split(",") if x.strip()]
        except ValueError:
            raise SystemExit("error: --spec-break-even wants request rates or 'auto'") from None
    print(f"speculation: {spec.method}, K={spec.num_speculative_tokens}"
          f"{' (adaptive)' if spec.adaptive else ''}; acceptance {acceptance.to_dict()}; "
          f"mean acceptance length at K: "
          f"{acceptance.mean_acceptance_length(spec.num_speculative_tokens):.2f}")
    points = sweep_loads(workload_at, rates, scheduler_config, cache_config, cost, spec,
                         acceptance)
    print(format_points(points, "req/s"))
    if out_dir is not None:
        path = out_dir / "spec_break_even.json"
        path.write_text(json.dumps({
            "schema": "iterserve.sim.spec_break_even/v1",
            "speculative_config": spec.to_dict(), "acceptance": acceptance.to_dict(),
            "capacity_rps": capacity_rps, "break_even_rps": break_even(points),
            "points": [{"rate": p.load, "tpot_off_ms": p.tpot_off_ms,
                        "tpot_on_ms": p.tpot_on_ms, "speedup": p.speedup,
                        "output_tok_s_off": p.throughput_off,
                        "output_tok_s_on": p.throughput_on,
                        "mean_acceptance_length": p.mean_acceptance_length}
                       for p in points],
        }, indent=1, allow_nan=True) + "\n")
        print(f"wrote {path}")
    return 0
