"""`iterserve simulate`: a workload through the production scheduler on a virtual clock.

    iterserve simulate --trace splitwise_conv --arrival poisson \\
        --request-rate 8 --model llama-2-7b --hardware h100 \\
        --scheduler static,dynamic,continuous --goodput ttft:500 tpot:50 --out sim_out/

Imports no torch: only the scheduler core, the cost model and numpy.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="simulate serving a workload (same scheduler, cost-model executor, virtual clock)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
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

    m = p.add_argument_group("cost model")
    m.add_argument("--profile", help="calibration JSON from `iterserve calibrate` (overrides the roofline)")
    m.add_argument("--model", default="llama-2-7b",
                   help="model preset (llama-2-7b, llama-2-13b, llama-3-8b, bench-small) or an HF "
                        "config.json / checkpoint directory (default llama-2-7b)")
    m.add_argument("--hardware", default="h100", help="a100 | h100 | h200 | l4 | cpu (default h100)")
    m.add_argument("--dtype", default=None, help="override the model dtype for the roofline")

    s = p.add_argument_group("engine")
    s.add_argument("--scheduler", default="continuous",
                   help="comma list of continuous, static, dynamic (several: compared side by side)")
    s.add_argument("--policy", default="fcfs", help="comma list of fcfs, priority, sjf, aging, fair, slo")
    s.add_argument("--max-num-seqs", type=int, default=128)
    s.add_argument("--max-num-batched-tokens", type=int, default=512)
    s.add_argument("--max-model-len", type=int, default=None,
                   help="default: the workload's longest request, at least 4096")
    s.add_argument("--no-chunked-prefill", action="store_true")
    s.add_argument("--long-prefill-token-threshold", type=int, default=0)
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--num-gpu-blocks", type=int, default=None,
                   help="KV cache blocks (default: what the hardware's memory leaves after the weights)")
    s.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    s.add_argument("--no-prefix-caching", action="store_true")
    s.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"])
    s.add_argument("--swap-space", type=int, default=0, help="host blocks for swap preemption")
    s.add_argument("--batch-size", type=int, default=32, help="static/dynamic batch size (default 32)")
    s.add_argument("--batch-window-ms", type=float, default=50.0, help="dynamic batching window")

    o = p.add_argument_group("output")
    o.add_argument("--goodput", nargs="+", metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50")
    o.add_argument("--sweep", default=None,
                   help="request rates (comma list, req/s) or 'auto' (fractions 0.2..1.4 of the "
                        "predicted capacity): throughput and p99 TTFT against offered load")
    o.add_argument("--compare-with", metavar="RESULT.json",
                   help="an `iterserve bench serve` result to show beside the simulation")
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


def run(args: argparse.Namespace) -> int:
    from iterserve.config import CacheConfig, SchedulerConfig
    from iterserve.sim import cost_model as cmod
    from iterserve.sim import report
    from iterserve.sim.simulator import Simulator, compute_metrics, stability_check
    from iterserve.sim.workload import make_workload

    goodput = _parse_goodput(args.goodput)

    # Cost model and KV budget.
    spec = None
    if args.profile:
        cost = cmod.CostModel.load(args.profile)
    else:
        spec = cmod.get_model_spec(args.model)
        if args.dtype:
            spec.dtype = args.dtype
        hw = cmod.get_hardware(args.hardware)
        cost = cmod.roofline_cost_model(spec, hw, args.block_size)
    num_blocks = args.num_gpu_blocks
    if num_blocks is None:
        if spec is None:
            try:
                spec = cmod.get_model_spec(args.model)
            except ValueError:
                spec = None
        if spec is None:
            raise SystemExit("--num-gpu-blocks is required with --profile and no model preset")
        num_blocks = cmod.kv_cache_blocks(
            spec, cmod.get_hardware(args.hardware), args.block_size, args.gpu_memory_utilization
        )

    # Workload.
    arrival = args.arrival or ("trace" if args.trace else "poisson")
    plen = args.prompt_len or ("trace" if args.trace else "uniform:32:1024")
    olen = args.output_len or ("trace" if args.trace else "lognormal:128:1.0:2048")
    num_requests = args.num_requests or (None if args.trace else 1000)

    def workload_at(rate: float | None):
        return make_workload(
            num_requests, arrival=arrival, rate=rate or 1.0, burstiness=args.burstiness,
            prompt_len=plen, output_len=olen, trace=args.trace,
            time_scale=args.time_scale if rate is None or arrival != "trace" else 0.0,
            seed=args.seed, reveal_output_len=args.reveal_output_len,
        )

    def configs(scheduler: str, policy: str, max_model_len: int):
        sc = SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=not args.no_chunked_prefill,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            scheduling_policy=policy,
            preemption_mode=args.preemption_mode,
            scheduler=scheduler,
            static_batch_size=args.batch_size,
            dynamic_batch_window_s=args.batch_window_ms / 1e3,
            # The slo policy's step-time model starts from the cost model's numbers.
            step_time_coefficients=(cost.t0, cost.prefill_token, cost.decode_seq,
                                    cost.context_token),
        )
        cc = CacheConfig(
            block_size=args.block_size, num_gpu_blocks=num_blocks,
            enable_prefix_caching=not args.no_prefix_caching, swap_space=args.swap_space,
        )
        return sc, cc

    schedulers = [x.strip() for x in args.scheduler.split(",") if x.strip()]
    policies = [x.strip() for x in args.policy.split(",") if x.strip()]
    runs = list(itertools.product(schedulers, policies))

    def label(sched: str, pol: str) -> str:
        if len(policies) == 1:
            return sched
        return pol if len(schedulers) == 1 else f"{sched}/{pol}"

    # The rate: given, the trace's own, or 90% of the predicted capacity.
    rate = args.request_rate
    probe = workload_at(rate if rate else None if arrival == "trace" else 1.0)
    mml = args.max_model_len or max(4096, probe.max_seq_len + 1)
    sc0, cc0 = configs(schedulers[0], policies[0], mml)
    cap = stability_check(probe, cost, sc0, cc0)
    if rate is None and arrival not in ("trace", "all-at-once"):
        rate = 0.9 * cap.capacity_requests_per_s
        print(f"--request-rate not given: using 90% of predicted capacity, {rate:.2f} req/s")
    wl = workload_at(rate) if rate is not None else probe

    print(f"cost model: {cost.name}  t = {cost.t0 * 1e3:.3f} ms + {cost.prefill_token * 1e6:.3f} us/prefill "
          f"tok + {cost.decode_seq * 1e6:.3f} us/decode seq + {cost.context_token * 1e9:.2f} ns/ctx tok "
          f"+ {cost.swap_block * 1e6:.1f} us/swap block")
    print(f"KV cache: {num_blocks:,} blocks x {args.block_size} tokens; {wl.describe()}")
    check = stability_check(wl, cost, sc0, cc0)
    print(check.message())
    if args.check_only:
        return 1 if check.is_oversubscribed else 0

    out_dir = Path(args.out) if args.out else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)

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
                sc, cc = configs(sched, pol, mml)
                res = Simulator(sc, cc, cost, label=label(sched, pol)).run(wlr)
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
        sc, cc = configs(sched, pol, mml)
        sim = Simulator(sc, cc, cost, progress=not args.no_progress, label=label(sched, pol))
        res = sim.run(wl)
        res.stability = check
        res.metrics = compute_metrics(res, goodput)
        results.append(res)
    columns = [(r.label, r.metrics) for r in results]
    if args.compare_with:
        columns.append(("measured", report.metrics_from_bench_result(args.compare_with)))
    report.print_table(columns, title=f"Simulation: {wl.name}", rich=not args.plain and sys.stdout.isatty())
    if out_dir:
        extra = {"workload": {"description": wl.describe(), **wl.meta},
                 "stability": check.message()}
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
