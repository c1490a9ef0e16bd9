"""`iterserve simulate`: a workload through the production scheduler on a virtual clock.

    iterserve simulate --trace splitwise_conv --arrival poisson \\
        --request-rate 8 --model llama-2-7b --hardware h100 \\
        --scheduler static,dynamic,continuous --goodput ttft:500 tpot:50 --out sim_out/

Imports no torch: only the scheduler core, the cost model and numpy (a ``.gguf`` file
as ``--model`` is read through the model loader, which does).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import sys
from pathlib import Path

from iterserve.cluster import ROUTER_POLICIES
from iterserve.config import EngineConfig, resolve_max_model_len
from iterserve.entrypoints import cli_simulate_spec
from iterserve.entrypoints.cli_simulate_pd import add_pd_args, run_pd, wants_pd
from iterserve.entrypoints.cli_simulate_pd import validate as validate_pd
from iterserve.entrypoints.engine_args import (
    CACHE_ARGS,
    SCHEDULER_ARGS,
    add_config_args,
    engine_args_dict,
    engine_kwargs_from_cli,
)
from iterserve.entrypoints.multi_turn_args import add_multi_turn_args, multi_turn_config

# The engine settings a simulation honours: the scheduler's and the KV cache's, and the
# dtype of the roofline (``auto``: the model's). The model, device and back end are
# not simulated (--model names a preset, --hardware the device; --profile measures both).
SIMULATE_ARGS = ("dtype", *SCHEDULER_ARGS, *CACHE_ARGS, "speculative_config")
# Compared side by side when given as a comma list.
SIMULATE_LISTS = ("scheduler", "scheduling_policy")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="simulate serving a workload (same scheduler, cost-model executor, virtual clock)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("action", nargs="?", choices=("plan",), default=None,
                   help="plan: the cheapest fleet (colocated or P/D split, GPU kinds, TP) "
                        "meeting --slo-ttft-ms / --slo-tpot-ms at --request-rate")
    w = p.add_argument_group("workload")
    w.add_argument("--trace", help="CSV (arrived_at,num_prefill_tokens,num_decode_tokens) or JSONL file, "
                   "or a shipped trace by name: splitwise_conv, splitwise_code")
    w.add_argument("--num-requests", type=int, default=None,
                   help="requests to simulate (default: the whole trace, else 1000)")
    w.add_argument("--arrival", default=None,
                   help="poisson | gamma | all-at-once | trace (default: trace with --trace, else poisson)")
    w.add_argument("--request-rate", type=float, default=None,
                   help="mean arrivals per second (default: 90%% of the predicted capacity)")
    w.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape: <1 burstier than Poisson, 1 Poisson (default 1)")
    w.add_argument("--prompt-len", default=None,
                   help="fixed:N | uniform:LO:HI | lognormal:MEAN:SIGMA[:MAX] | pareto:MIN:ALPHA[:MAX] "
                        "| trace (default: trace with --trace, else uniform:32:1024)")
    w.add_argument("--output-len", default=None,
                   help="as --prompt-len (default: trace with --trace, else lognormal:128:1.0:2048)")
    w.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply trace arrival times (0: rescale them to --request-rate)")
    w.add_argument("--reveal-output-len", action="store_true",
                   help="tell the scheduler each output length as max_tokens (oracle, for sjf)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--workload", choices=("synthetic", "multi-turn"), default="synthetic",
                   help="synthetic: the arrival and length flags (or --trace); multi-turn: chat "
                        "sessions over per-tenant system prompts (--multi-turn-*; --request-rate "
                        "is then turns per second)")
    add_multi_turn_args(w)
    c = p.add_argument_group("cluster")
    c.add_argument("--num-replicas", type=int, default=1,
                   help="engine replicas behind a router (default 1: one engine, no router)")
    c.add_argument("--router-policy", default="cache_aware",
                   help="routing policy, or a comma list to compare: "
                        f"{', '.join(ROUTER_POLICIES)} (default cache_aware)")
    c.add_argument("--router-stats-period", type=float, default=0.0,
                   help="seconds between the router's polls of replica stats (as Ray Serve's); "
                        "0: fresh stats at every decision (default 0)")

    m = p.add_argument_group("cost model")
    o = p.add_argument_group("output")
    add_pd_args(c, o)
    m.add_argument("--profile", help="calibration JSON from `iterserve calibrate` (overrides the roofline)")
    m.add_argument("--model", default="llama-2-7b",
                   help="model preset (llama-2-7b, llama-2-13b, llama-3-8b, bench-small) or an HF "
                        "config.json / checkpoint directory (default llama-2-7b)")
    m.add_argument("--hardware", default="h100", help="a100 | h100 | h200 | l4 | cpu (default h100)")
    m.add_argument("--quantization", "-q", default=None,
                   help="price the weights in this format: q8_0 | q6_k | q4_0 | q4_k | q4_k_m "
                        "| int8 | int4 | w4a16 | w8a8 (default: as the model stores them: a "
                        ".gguf file's own types, a compressed-tensors checkpoint's format, "
                        "else the dtype)")
    # The engine settings: the same flags, defaults and parsing as `serve`, from the config.
    s = p.add_argument_group("speculative decoding")
    add_config_args(p, SIMULATE_ARGS, lists=SIMULATE_LISTS,
                    groups={"model": m, "speculative decoding": s})
    cli_simulate_spec.add_args(s)
    o.add_argument("--goodput", nargs="+", metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50")
    o.add_argument("--sweep", default=None,
                   help="request rates (comma list, req/s) or 'auto' (fractions 0.2..1.4 of the "
                        "predicted capacity): throughput and p99 TTFT against offered load")
    o.add_argument("--compare-with", metavar="RESULT.json",
                   help="an `iterserve bench serve` result, or a server's request log "
                        "(`serve --request-log`, .jsonl), to show beside the simulation")
    o.add_argument("--out", default=None, help="directory for result.json and PNG plots")
    o.add_argument("--no-plots", action="store_true")
    o.add_argument("--save-records", action="store_true", help="per-request records in the JSON")
    o.add_argument("--plain", action="store_true", help="plain-text table (no rich)")
    o.add_argument("--no-progress", action="store_true")
    o.add_argument("--check-only", action="store_true", help="print the stability check and exit")
    p.set_defaults(func=run)


def _parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    slos: dict[str, float] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition(":")
        name = {"e2el": "e2e"}.get(name, name)
        try:
            ms = float(value)
        except ValueError:
            ms = math.nan
        if not sep or math.isnan(ms) or ms < 0 or name not in ("ttft", "tpot", "e2e"):
            raise SystemExit(f"--goodput wants ttft|tpot|e2e:MILLISECONDS pairs, got {pair!r}")
        slos[name] = ms
    return slos


def engine_config(args: argparse.Namespace, scheduler: str, policy: str) -> EngineConfig:
    """The unresolved engine settings of one simulated run, as ``serve`` builds them
    from the same flags (one value each of the comma-list ones)."""
    from iterserve.engine.builder import engine_config_from_args

    kw = engine_kwargs_from_cli(args, SIMULATE_ARGS)
    kw.update(scheduler=scheduler, scheduling_policy=policy)
    return engine_config_from_args(None, **kw)


def num_gpu_blocks(args: argparse.Namespace, cfg: EngineConfig, cost, max_model_len: int) -> int:
    """KV blocks by the server's sizing rule: the override, else --kv-cache-memory, else
    what the engine sized on the calibrated machine (--profile), else the memory the
    hardware preset leaves after the model's weights."""
    from iterserve.sim import cost_model as cmod

    cache = cfg.cache
    if cache.num_gpu_blocks is not None:
        return cache.num_gpu_blocks
    measured = cost.meta.get("num_gpu_blocks") if args.profile else None
    if measured and cache.kv_cache_memory is None:
        # The same memory in this run's block size.
        blocks = int(measured) * int(cost.meta.get("block_size") or cache.block_size)
        blocks //= cache.block_size
        print(f"KV cache: {blocks} blocks, as sized by the engine calibrated in {args.profile}")
        return blocks
    try:
        spec = _model_spec(args)
    except ValueError as e:
        raise SystemExit(f"{e}; or give --num-gpu-blocks-override") from None
    try:
        return cmod.kv_cache_blocks(
            spec, cmod.get_hardware(args.hardware), cache=cache,
            max_num_seqs=cfg.scheduler.max_num_seqs, max_model_len=max_model_len,
            tensor_parallel_size=args.tensor_parallel_size,
        )
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def _size(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.2f} MB"


def _model_spec(args: argparse.Namespace):
    from iterserve.sim import cost_model as cmod

    q = args.quantization
    # vLLM's names for "as the checkpoint says": the file or config decides.
    spec = cmod.get_model_spec(args.model, None if q in ("gguf", "compressed-tensors") else q)
    spec = dataclasses.replace(spec, kv_cache_dtype=getattr(args, "cache_dtype", "auto"))
    return spec if args.dtype == "auto" else dataclasses.replace(spec, dtype=args.dtype)


def compare_engine_args(result_path: str, cfg: EngineConfig) -> list[str]:
    """Where the measured run's engine settings (``engine_args`` in the bench result,
    when its producer recorded them) differ from the simulation's: one line each."""
    import json

    from iterserve.sim.report import is_request_log

    if is_request_log(result_path):
        return [f"{result_path} is a request log, which does not record the server's engine "
                "settings: make sure the simulation's flags match the server's"]
    with open(result_path, encoding="utf-8") as f:
        result = json.load(f)
    recorded = result.get("engine_args") if isinstance(result, dict) else None
    if not isinstance(recorded, dict):
        return [f"{result_path} does not record the measured engine's settings (engine_args): "
                "make sure the simulation's flags match the server's"]
    simulated = engine_args_dict(cfg)
    out = []
    for name in SIMULATE_ARGS:
        if name in recorded and name in simulated and recorded[name] != simulated[name]:
            out.append(f"the measured engine ran with {name}={recorded[name]!r}, "
                       f"the simulation with {simulated[name]!r}")
    return out


def run(args: argparse.Namespace) -> int:
    from iterserve.sim import cost_model as cmod
    from iterserve.sim import report
    from iterserve.sim.simulator import Simulator, compute_metrics, stability_check
    from iterserve.sim.workload import make_multi_turn_workload, make_workload

    goodput = _parse_goodput(args.goodput)
    validate_pd(args)
    schedulers: list[str] = args.scheduler
    policies: list[str] = args.scheduling_policy
    runs = list(itertools.product(schedulers, policies))
    try:
        base = {run: engine_config(args, *run) for run in runs}
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None

    # Cost model.
    if args.profile:
        cost = cmod.CostModel.load(args.profile)
        if args.quantization and args.quantization.lower() != (cost.quantization or "none"):
            raise SystemExit(
                f"error: --quantization {args.quantization}: {args.profile} prices the weights "
                f"it was calibrated with ({cost.quantization or 'float'}); calibrate the "
                "quantized model (`iterserve calibrate --model ... --quantization ...`) or "
                "drop --profile to use the roofline")
    else:
        try:
            spec = _model_spec(args)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
        try:
            cost = cmod.roofline_cost_model(spec, cmod.get_hardware(args.hardware),
                                            args.block_size, args.tensor_parallel_size)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None

    # Workload.
    arrival = args.arrival or ("trace" if args.trace else "poisson")
    plen = args.prompt_len or ("trace" if args.trace else "uniform:32:1024")
    olen = args.output_len or ("trace" if args.trace else "lognormal:128:1.0:2048")
    num_requests = args.num_requests or (None if args.trace else 1000)

    multi_turn = None
    if args.workload == "multi-turn":
        if args.trace:
            raise SystemExit("error: --workload multi-turn makes its own prompts: drop --trace")
        try:
            multi_turn = multi_turn_config(args, vocab_size=32000)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
    nrep = args.num_replicas
    if nrep < 1:
        raise SystemExit(f"error: --num-replicas must be >= 1, got {nrep}")

    def workload_at(rate: float | None):
        if multi_turn is not None:
            return make_multi_turn_workload(
                num_requests or 1000, multi_turn, rate=rate or 1.0, seed=args.seed,
                reveal_output_len=args.reveal_output_len)
        return make_workload(
            num_requests, arrival=arrival, rate=rate or 1.0, burstiness=args.burstiness,
            prompt_len=plen, output_len=olen, trace=args.trace,
            time_scale=args.time_scale if rate is None or arrival != "trace" else 0.0,
            seed=args.seed, reveal_output_len=args.reveal_output_len,
        )

    # The rate: given, the trace's own, or 90% of the predicted capacity.
    rate = args.request_rate
    probe = workload_at(rate if rate else None if arrival == "trace" else 1.0)
    # Resolved once, as the builder resolves a served engine's: the context length
    # (the workload's longest request, at least 4096, when not given) and the KV blocks.
    mml = resolve_max_model_len(base[runs[0]].scheduler, max(4096, probe.max_seq_len + 1))
    if wants_pd(args):
        if len(runs) > 1:
            raise SystemExit("error: disaggregation and plan run one --scheduler / "
                             "--scheduling-policy")
        if rate is None and arrival != "trace":
            raise SystemExit("error: disaggregation and plan need --request-rate (or "
                             "--arrival trace)")
        return run_pd(args, workload_at, rate, base[runs[0]], mml, goodput, _model_spec(args))
    num_blocks = num_gpu_blocks(args, base[runs[0]], cost, mml)
    try:
        resolved = {k: c.resolve(max_model_len=mml, num_gpu_blocks=num_blocks)
                    for k, c in base.items()}
        # The slo policy's step-time model starts from the cost model's numbers (a
        # served engine learns them online).
        coeffs = (cost.t0, cost.prefill_token, cost.decode_seq, cost.context_token)
        resolved = {k: dataclasses.replace(c, scheduler=dataclasses.replace(
            c.scheduler, step_time_coefficients=coeffs)) for k, c in resolved.items()}
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None

    spec_cfg = resolved[runs[0]].speculative_config
    acceptance = cli_simulate_spec.acceptance_for(args, spec_cfg)
    if spec_cfg is not None and (set(schedulers) != {"continuous"} or nrep > 1):
        raise SystemExit("error: --speculative-config is simulated with the continuous "
                         "scheduler on one engine (no --num-replicas)")

    def configs(sched: str, pol: str):
        cfg = resolved[(sched, pol)]
        return cfg.scheduler, cfg.cache

    sc0, cc0 = configs(*runs[0])
    cap = stability_check(probe, cost, sc0, cc0)
    if rate is None and arrival not in ("trace", "all-at-once"):
        rate = 0.9 * cap.capacity_requests_per_s * nrep
        print(f"--request-rate not given: using 90% of predicted capacity, {rate:.2f} req/s")
    wl = workload_at(rate) if rate is not None else probe

    def label(sched: str, pol: str) -> str:
        if len(policies) == 1:
            return sched
        return pol if len(schedulers) == 1 else f"{sched}/{pol}"

    print(f"cost model: {cost.name}  t = {cost.t0 * 1e3:.3f} ms + {cost.prefill_token * 1e6:.3f} us/prefill "
          f"tok + {cost.decode_seq * 1e6:.3f} us/decode seq + {cost.context_token * 1e9:.2f} ns/ctx tok "
          f"+ {cost.swap_block * 1e6:.1f} us/swap block"
          + (f" + {cost.expert_read * 1e6:.1f} us/active expert ({cost.experts_per_token} of "
             f"{cost.num_experts} per token)" if cost.num_experts else ""))
    if cost.has_long_context or cost.has_lone_excess:
        from iterserve.sim.long_context import format_long_context

        print("long contexts: " + format_long_context(cost))
    if cost.bytes_per_weight:
        print(f"weights: {cost.quantization or 'float'}, {cost.bytes_per_weight:.3f} bytes/weight, "
              f"{_size(cost.weight_bytes)} read every step")
    print(f"KV cache: {num_blocks:,} blocks x {args.block_size} tokens; {wl.describe()}")
    check = stability_check(wl, cost, sc0, cc0)
    print(check.message())
    if args.check_only:
        return 1 if check.is_oversubscribed else 0

    out_dir = Path(args.out) if args.out else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)

    if args.spec_break_even:
        assert spec_cfg is not None and acceptance is not None
        return cli_simulate_spec.run_break_even(
            args, workload_at, check.capacity_requests_per_s, sc0, cc0, cost, spec_cfg,
            acceptance, out_dir)

    if nrep > 1:
        from iterserve.entrypoints.cli_simulate_cluster import run_cluster

        return run_cluster(args, wl, runs, configs, cost, goodput, check, out_dir,
                           engine_args_dict(resolved[runs[0]]))

    if args.sweep:
        if arrival == "all-at-once":
            raise SystemExit("--sweep needs an arrival process with a rate")
        base_cap = check.capacity_requests_per_s
        if args.sweep == "auto":
            rates = [round(f * base_cap, 4) for f in (0.2, 0.4, 0.6, 0.8, 0.9, 1.0, 1.1, 1.25, 1.4)]
        else:
            rates = [float(x) for x in args.sweep.split(",") if x.strip()]
        sweep: dict[str, list] = {}
        from tqdm import tqdm

        bar = tqdm(total=len(rates) * len(runs), desc="sweep", unit="run",
                   disable=args.no_progress)
        rows = []
        for sched, pol in runs:
            pts = []
            for r in rates:
                wlr = workload_at(r)
                sc, cc = configs(sched, pol)
                res = Simulator(sc, cc, cost, label=label(sched, pol),
                                speculative_config=spec_cfg, acceptance=acceptance).run(wlr)
                met = compute_metrics(res, goodput)
                pts.append((r, met))
                rows.append((label(sched, pol), r, met))
                bar.update(1)
            sweep[label(sched, pol)] = pts
        bar.close()
        print(f"{'run':<22}{'rate':>10}{'thru req/s':>12}{'out tok/s':>12}{'p99 TTFT ms':>14}"
              f"{'mean batch':>12}")
        for lab, r, met in rows:
            print(f"{lab:<22}{r:>10.2f}{met['request_throughput']:>12.2f}"
                  f"{met['output_token_throughput']:>12.0f}{met['ttft_ms']['p99']:>14.1f}"
                  f"{met.get('mean_batch_size', 0):>12.1f}")
        if out_dir:
            import json

            (out_dir / "sweep.json").write_text(json.dumps(report._clean(
                {"schema": "iterserve.sim.sweep/v1", "capacity_rps": base_cap,
                 "runs": {k: [{"rate": r, "metrics": mm} for r, mm in v] for k, v in sweep.items()}}
            ), indent=1, default=report._json_default))
            if not args.no_plots:
                path = report.plot_sweep(sweep, out_dir / "sweep.png", capacity_rps=base_cap)
                print(f"wrote {out_dir / 'sweep.json'}, {path}")
        return 0

    results = []
    for sched, pol in runs:
        sc, cc = configs(sched, pol)
        sim = Simulator(sc, cc, cost, progress=not args.no_progress, label=label(sched, pol),
                        speculative_config=spec_cfg, acceptance=acceptance)
        res = sim.run(wl)
        res.stability = check
        res.metrics = compute_metrics(res, goodput)
        results.append(res)
    columns = [(r.label, r.metrics) for r in results]
    if args.compare_with:
        columns.append(("measured", report.metrics_from_measured(args.compare_with)))
        for line in compare_engine_args(args.compare_with, resolved[runs[0]]):
            print(f"warning: {line}", file=sys.stderr)
    report.print_table(columns, title=f"Simulation: {wl.name}", rich=not args.plain and sys.stdout.isatty())
    if out_dir:
        extra = {"workload": {"description": wl.describe(), **wl.meta},
                 "stability": check.message(),
                 # The first run's settings, as a bench result records a server's.
                 "engine_args": engine_args_dict(resolved[runs[0]])}
        if args.compare_with:
            extra["measured"] = {"path": args.compare_with, "metrics": columns[-1][1]}
        path = report.save_json(out_dir / "result.json", results, extra,
                                with_records=args.save_records)
        written = [str(path)]
        if not args.no_plots:
            written.append(str(report.plot_timelines(results, out_dir / "timeline.png")))
            written.append(str(report.plot_cdfs(results, out_dir / "latency_cdf.png")))
        print("wrote " + ", ".join(written))
    return 0
