"""The long soak, by hand: a real ``iterserve serve`` over capacity for as long as you
like, then the same audit as tests/soak (nothing lost, nothing leaked, /health
responsive, RSS flat, greedy outputs unchanged).

    .venv/bin/python benchmarks/soak.py --duration 600
    .venv/bin/python benchmarks/soak.py --duration 3600 --overload 5 --json soak.json

Exit status 1 when the audit finds a problem. With no --model, the built-in tiny
random-weight model (iterserve-tiny-random, iterserve.model.default_model) is built in a
temporary directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from iterserve.model.default_model import ensure_random_model
from results import BenchmarkRun
from soak_harness import SoakConfig, run_soak


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=300.0, help="seconds of overload")
    p.add_argument("--overload", type=float, default=3.0,
                   help="offered rate as a multiple of the rate the server sustains")
    p.add_argument("--model", type=Path, default=None, help="checkpoint directory")
    p.add_argument("--num-gpu-blocks", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--faults", type=int, default=4,
                   help="failing steps to inject (and half as many hung steps)")
    p.add_argument("--json", type=Path, default=None, help="write the report here")
    args = p.parse_args()

    k = max(args.faults, 0)
    cfg = SoakConfig(
        duration_s=args.duration, overload=args.overload, seed=args.seed,
        num_gpu_blocks=args.num_gpu_blocks,
        raise_at=tuple((i + 1) / (k + 1) for i in range(k)),
        hang_at=tuple((i + 0.5) / (k // 2 + 1) for i in range(k // 2)),
    )
    rec = BenchmarkRun("soak", "Soak over capacity", [
        "src/iterserve/entrypoints", "src/iterserve/engine", "src/iterserve/core",
        "benchmarks/soak.py", "benchmarks/soak_harness"]).start()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            model = ensure_random_model(Path(tmp))
        print(f"soak: {args.duration:.0f} s at {args.overload}x on {platform.node()} "
              f"({platform.processor() or platform.machine()}), model {model}", flush=True)
        report = run_soak(model, cfg, Path(tmp))
    print(report.table())
    labels = {"duration_s": args.duration, "overload": args.overload,
              "model": str(args.model) if args.model else "default"}
    for name in ("accepted", "lost", "blocks_leaked", "duplicates", "health_failures",
                 "greedy_mismatches", "offered_rps", "sustained_rps", "health_max_s",
                 "rss_first_mib", "rss_second_mib"):
        rec.figure(name.replace("_", " "), getattr(report, name),
                   headline=name in ("accepted", "lost", "blocks_leaked"), **labels)
    rec.figure("audit problems", len(report.problems), **labels)
    for problem in report.problems:
        rec.note(problem)
    rec.finish()
    if args.json is not None:
        args.json.write_text(json.dumps(dataclasses.asdict(report), indent=2))
    return 1 if report.problems or report.lost or report.blocks_leaked else 0


if __name__ == "__main__":
    raise SystemExit(main())
