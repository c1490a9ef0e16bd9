"""`iterserve simulate --num-prefill-replicas P --num-decode-replicas D` and
`iterserve simulate plan`: prefill/decode disaggregation in the simulator
(sim/disagg.py) and the cheapest fleet meeting an SLO pair (sim/plan.py).

    iterserve simulate --trace splitwise_conv --arrival poisson --request-rate 8 \\
        --model llama-2-70b --tensor-parallel-size 8 \\
        --num-prefill-replicas 1 --num-decode-replicas 1 \\
        --prefill-hardware h100 --decode-hardware a100 --kv-link-gbps 400 \\
        --slo-ttft-ms 1000 --slo-tpot-ms 50

    iterserve simulate plan --trace splitwise_conv --arrival poisson --request-rate 8 \\
        --model llama-2-70b --plan-hardware a100,h100 --plan-tensor-parallel-sizes 4,8 \\
        --slo-ttft-ms 1000 --slo-tpot-ms 50 --goodput-target 0.9 --out plan_out/
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from iterserve.config import EngineConfig

DEFAULT_LINK_GBPS = 400.0  # one 400 Gb/s NIC (ConnectX-7 / InfiniBand NDR) per replica
DEFAULT_LINK_LATENCY_MS = 1.0


def add_pd_args(c: argparse._ArgumentGroup, o: argparse._ArgumentGroup) -> None:
    """The disaggregation, tensor-parallel and planning flags (cluster and output groups)."""
    c.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                   help="GPUs per replica, weights and KV split over them (vLLM's flag); "
                        "priced with two all-reduces per layer (default 1)")
    c.add_argument("--num-prefill-replicas", type=int, default=None,
                   help="prefill/decode disaggregation: replicas that only prefill (with "
                        "--num-decode-replicas)")
    c.add_argument("--num-decode-replicas", type=int, default=None,
                   help="replicas that decode from the transferred KV")
    c.add_argument("--prefill-hardware", default=None, help="prefill replicas' GPU (default --hardware)")
    c.add_argument("--decode-hardware", default=None, help="decode replicas' GPU (default --hardware)")
    c.add_argument("--prefill-tensor-parallel-size", type=int, default=None,
                   help="prefill replicas' TP size (default --tensor-parallel-size)")
    c.add_argument("--decode-tensor-parallel-size", type=int, default=None,
                   help="decode replicas' TP size (default --tensor-parallel-size)")
    c.add_argument("--kv-link-gbps", type=float, default=DEFAULT_LINK_GBPS,
                   help="each prefill replica's KV link in Gb/s; its transfers queue on it "
                        f"(default {DEFAULT_LINK_GBPS:g})")
    c.add_argument("--kv-link-latency-ms", type=float, default=DEFAULT_LINK_LATENCY_MS,
                   help=f"fixed cost of one KV transfer (default {DEFAULT_LINK_LATENCY_MS:g} ms)")
    c.add_argument("--decode-router-policy", default="least_kv",
                   help="routing among decode replicas (default least_kv; prefill replicas "
                        "use --router-policy)")
    # Reporting SLOs; the slo scheduling policy's own targets are --ttft-slo-ms / --tpot-slo-ms.
    o.add_argument("--slo-ttft-ms", type=float, default=None,
                   help="TTFT SLO for goodput and plan (same as --goodput ttft:MS)")
    o.add_argument("--slo-tpot-ms", type=float, default=None,
                   help="TPOT SLO for goodput and plan (same as --goodput tpot:MS)")
    p = o  # the plan's flags sit with the output's
    p.add_argument("--plan-hardware", default=None,
                   help="plan: GPU kinds to try, comma list (default --hardware)")
    p.add_argument("--plan-tensor-parallel-sizes", default=None,
                   help="plan: TP sizes to try, comma list (default: the smallest power of two "
                        "each GPU kind fits the model with)")
    p.add_argument("--plan-max-gpus", type=int, default=32, help="plan: most GPUs a fleet may use (default 32)")
    p.add_argument("--plan-modes", default="colocated,disaggregated",
                   help="plan: colocated, disaggregated or both (default both)")
    p.add_argument("--goodput-target", type=float, default=0.9,
                   help="plan: fraction of requests within every SLO a fleet must reach (default 0.9)")
    p.add_argument("--plan-rates", default=None,
                   help="plan: rates (req/s, comma list) for the goodput-vs-rate plot "
                        "(default 0.25x..2x --request-rate)")


def wants_pd(args: argparse.Namespace) -> bool:
    return (getattr(args, "action", None) == "plan" or args.num_prefill_replicas is not None
            or args.num_decode_replicas is not None)


def _fail(msg: str) -> SystemExit:
    return SystemExit(f"error: {msg}")


def _int_list(flag: str, value: str) -> list[int]:
    try:
        out = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise _fail(f"{flag} wants a comma list of integers, got {value!r}") from None
    if not out or min(out) < 1:
        raise _fail(f"{flag} wants integers >= 1, got {value!r}")
    return out


def validate(args: argparse.Namespace) -> None:
    """Bad values of the flags above: an error naming the flag."""
    from iterserve.cluster import ROUTER_POLICIES
    from iterserve.sim.hardware import get_hardware

    def positive_int(flag: str, v: int | None) -> None:
        if v is not None and v < 1:
            raise _fail(f"{flag} must be >= 1, got {v}")

    positive_int("--tensor-parallel-size", args.tensor_parallel_size)
    positive_int("--prefill-tensor-parallel-size", args.prefill_tensor_parallel_size)
    positive_int("--decode-tensor-parallel-size", args.decode_tensor_parallel_size)
    positive_int("--num-prefill-replicas", args.num_prefill_replicas)
    positive_int("--num-decode-replicas", args.num_decode_replicas)
    positive_int("--plan-max-gpus", args.plan_max_gpus)
    is_plan = getattr(args, "action", None) == "plan"
    if not is_plan and (args.num_prefill_replicas is None) != (args.num_decode_replicas is None):
        raise _fail("--num-prefill-replicas and --num-decode-replicas go together")
    if wants_pd(args) and args.num_replicas != 1:
        raise _fail("--num-replicas is for colocated replicas: drop it with "
                    "--num-prefill-replicas / --num-decode-replicas / plan")
    if not (math.isfinite(args.kv_link_gbps) and args.kv_link_gbps > 0):
        raise _fail(f"--kv-link-gbps must be > 0, got {args.kv_link_gbps}")
    if not (math.isfinite(args.kv_link_latency_ms) and args.kv_link_latency_ms >= 0):
        raise _fail(f"--kv-link-latency-ms must be >= 0, got {args.kv_link_latency_ms}")
    for flag in ("slo_ttft_ms", "slo_tpot_ms"):
        v = getattr(args, flag)
        if v is not None and not (math.isfinite(v) and v > 0):
            raise _fail(f"--{flag.replace('_', '-')} must be > 0, got {v}")
    if not 0 < args.goodput_target <= 1:
        raise _fail(f"--goodput-target must be in (0, 1], got {args.goodput_target}")
    for flag in ("hardware", "prefill_hardware", "decode_hardware"):
        v = getattr(args, flag)
        if v is not None and v.lower() not in ("cpu", "this-cpu", "this_cpu"):
            try:
                get_hardware(v)
            except ValueError as e:
                raise _fail(f"--{flag.replace('_', '-')}: {e}") from None
    for h in (args.plan_hardware or "").split(","):
        if h.strip():
            try:
                get_hardware(h.strip())
            except ValueError as e:
                raise _fail(f"--plan-hardware: {e}") from None
    if args.plan_tensor_parallel_sizes:
        _int_list("--plan-tensor-parallel-sizes", args.plan_tensor_parallel_sizes)
    modes = [m.strip() for m in args.plan_modes.split(",") if m.strip()]
    if not modes or set(modes) - {"colocated", "disaggregated"}:
        raise _fail(f"--plan-modes wants colocated and/or disaggregated, got {args.plan_modes!r}")
    if args.decode_router_policy not in ROUTER_POLICIES:
        raise _fail(f"--decode-router-policy must be one of {', '.join(ROUTER_POLICIES)}, "
                    f"got {args.decode_router_policy!r}")
    if wants_pd(args) and args.profile:
        raise _fail("--profile prices the one device it calibrated: disaggregation and plan "
                    "price each pool's GPUs by the roofline (--prefill-hardware, "
                    "--decode-hardware, --plan-hardware)")


def slos(args: argparse.Namespace, goodput: dict[str, float]) -> dict[str, float]:
    out = dict(goodput)
    if args.slo_ttft_ms is not None:
        out["ttft"] = args.slo_ttft_ms
    if args.slo_tpot_ms is not None:
        out["tpot"] = args.slo_tpot_ms
    return out


def pool_factory(args: argparse.Namespace, base: EngineConfig, max_model_len: int,
                 spec: Any) -> Callable[[str, int], tuple[Any, Any, Any]]:
    """(hardware, TP) -> the roofline cost model and the configs resolved as a served
    engine's on that many of those GPUs (ValueError when the model does not fit)."""
    from iterserve.sim import cost_model as cmod

    def make(hardware: str, tp: int) -> tuple[Any, Any, Any]:
        hw = cmod.get_hardware(hardware)
        cost = cmod.roofline_cost_model(spec, hw, args.block_size, tp)
        cache = base.cache
        blocks = cache.num_gpu_blocks or cmod.kv_cache_blocks(
            spec, hw, cache=cache, max_num_seqs=base.scheduler.max_num_seqs,
            max_model_len=max_model_len, tensor_parallel_size=tp)
        cfg = base.resolve(max_model_len=max_model_len, num_gpu_blocks=blocks)
        coeffs = (cost.t0, cost.prefill_token, cost.decode_seq, cost.context_token)
        sched = dataclasses.replace(cfg.scheduler, step_time_coefficients=coeffs)
        return cost, sched, cfg.cache

    return make


def _print_rows(title: str, header: list[str], rows: list[list[str]], rich: bool) -> None:
    if rich:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=title)
        for k, h in enumerate(header):
            t.add_column(h, justify="left" if k == 0 else "right")
        for r in rows:
            t.add_row(*r)
        Console().print(t)
        return
    print(f"\n{title}\n| " + " | ".join(header) + " |\n" + "|---" * len(header) + "|")
    for r in rows:
        print("| " + " | ".join(r) + " |")


def phase_rows(m: dict[str, Any]) -> list[list[str]]:
    """Per phase of a P/D run: mean / p50 / p90 / p99 (ms) and the SLO met."""
    ph = m["phases"]

    def row(name: str, d: dict[str, float], slo: float | None = None) -> list[str]:
        return [name, *(f"{d.get(k, math.nan):.1f}" for k in ("mean", "median", "p90", "p99")),
                "" if slo is None else f"{slo:.1%}"]

    return [
        row("prefill queue", ph["prefill"]["queue_ms"]),
        row("prefill compute", ph["prefill"]["compute_ms"]),
        row("TTFT (prefill)", ph["prefill"]["ttft_ms"], ph["prefill"].get("slo_fraction")),
        row("KV link wait", ph["transfer"]["wait_ms"]),
        row("KV transfer", ph["transfer"]["time_ms"]),
        row("decode queue", ph["decode"]["queue_ms"]),
        row("TPOT (decode replica)", ph["decode"]["tpot_ms"]),
        row("TPOT (end to end)", m["tpot_ms"], ph["decode"].get("slo_fraction")),
        row("E2E", m["e2e_ms"]),
    ]


def run_pd(args: argparse.Namespace, workload_at: Callable[[float | None], Any], rate: float | None,
           base: EngineConfig, max_model_len: int, goodput: dict[str, float], spec: Any) -> int:
    from iterserve.sim import report
    from iterserve.sim.disagg import DisaggSimulator, KVLink, PhaseConfig, pd_metrics

    slo = slos(args, goodput)
    if getattr(args, "action", None) == "plan":
        return run_plan(args, workload_at, rate, base, max_model_len, slo, spec)
    pools = pool_factory(args, base, max_model_len, spec)
    ph = args.prefill_hardware or args.hardware
    dh = args.decode_hardware or args.hardware
    ptp = args.prefill_tensor_parallel_size or args.tensor_parallel_size
    dtp = args.decode_tensor_parallel_size or args.tensor_parallel_size
    try:
        pcost, psc, pcc = pools(ph, ptp)
        dcost, dsc, dcc = pools(dh, dtp)
        link = KVLink(args.kv_link_gbps, args.kv_link_latency_ms / 1e3)
        sim = DisaggSimulator(
            PhaseConfig(psc, pcc, pcost, args.num_prefill_replicas, args.router_policy,
                        gpus_per_replica=ptp),
            PhaseConfig(dsc, dcc, dcost, args.num_decode_replicas, args.decode_router_policy,
                        gpus_per_replica=dtp),
            kv_bytes_per_token=spec.kv_bytes_per_token, link=link,
            stats_period_s=args.router_stats_period, label="disaggregated")
    except ValueError as e:
        raise _fail(str(e)) from None
    wl = workload_at(rate)
    print(f"prefill: {args.num_prefill_replicas} x {pcost.name}, {pcc.num_gpu_blocks:,} KV blocks; "
          f"decode: {args.num_decode_replicas} x {dcost.name}, {dcc.num_gpu_blocks:,} KV blocks")
    print(f"KV: {spec.kv_bytes_per_token / 1e3:.1f} kB/token over {args.kv_link_gbps:g} Gb/s + "
          f"{args.kv_link_latency_ms:g} ms per transfer; {wl.describe()}")
    if not args.no_progress:
        print("simulating ...", file=sys.stderr)
    run = sim.run(wl)
    m = pd_metrics(run, slo)
    run.result.metrics = m
    rich = not args.plain and sys.stdout.isatty()
    report.print_table([("disaggregated", m)], title=f"Simulation: {wl.name}, P/D "
                       f"{args.num_prefill_replicas}:{args.num_decode_replicas}", rich=rich)
    _print_rows("Per phase (ms)", ["phase", "mean", "p50", "p90", "p99", "within SLO"],
                phase_rows(m), rich)
    gpus = sim.num_gpus
    price = (args.num_prefill_replicas * ptp * pools_price(ph)
             + args.num_decode_replicas * dtp * pools_price(dh))
    print(f"{gpus} GPUs, ${price:.2f}/h at the presets' prices")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        extra = {"workload": {"description": wl.describe(), **wl.meta},
                 "disaggregation": sim.describe(), "slos_ms": slo,
                 "price_per_hour": price}
        path = report.save_json(out / "result.json", [run.result], extra,
                                with_records=args.save_records)
        written = [str(path)]
        if not args.no_plots:
            written.append(str(report.plot_cdfs([run.result], out / "latency_cdf.png")))
        print("wrote " + ", ".join(written))
    return 0


def pools_price(hardware: str) -> float:
    from iterserve.sim.hardware import get_hardware

    return get_hardware(hardware).price_per_hour


def default_tp(spec: Any, hardware: str, fits: Callable[[str, int], bool]) -> list[int]:
    """The smallest power of two (up to 8) that ``hardware`` fits the model with."""
    for tp in (1, 2, 4, 8):
        if spec.num_heads % tp == 0 and fits(hardware, tp):
            return [tp]
    return []


def run_plan(args: argparse.Namespace, workload_at: Callable[[float | None], Any],
             rate: float | None, base: EngineConfig, max_model_len: int,
             slo: dict[str, float], spec: Any) -> int:
    from iterserve.sim.disagg import KVLink
    from iterserve.sim.plan import Planner, plan

    if rate is None:
        raise _fail("plan needs --request-rate (the load the fleet must serve)")
    if not slo:
        raise _fail("plan needs an SLO: --slo-ttft-ms and/or --slo-tpot-ms (or --goodput)")
    planner = Planner(pool_factory(args, base, max_model_len, spec), spec.kv_bytes_per_token,
                      KVLink(args.kv_link_gbps, args.kv_link_latency_ms / 1e3), slo,
                      router_policy=args.router_policy,
                      decode_router_policy=args.decode_router_policy,
                      stats_period_s=args.router_stats_period)
    hardware = [h.strip() for h in (args.plan_hardware or args.hardware).split(",") if h.strip()]
    if args.plan_tensor_parallel_sizes:
        tps = _int_list("--plan-tensor-parallel-sizes", args.plan_tensor_parallel_sizes)
        tp_sizes = {h: tps for h in hardware}
    else:
        tp_sizes = {h: default_tp(spec, h, planner.fits) for h in hardware}
    for h, tps in tp_sizes.items():
        fitting = [tp for tp in tps if planner.fits(h, tp)]
        if not fitting:
            raise _fail(f"{spec.name} fits {h} at none of the tensor parallel sizes "
                        f"{tps or [1, 2, 4, 8]}: try larger --plan-tensor-parallel-sizes")
    modes = [m.strip() for m in args.plan_modes.split(",") if m.strip()]
    wl = workload_at(rate)
    print(f"plan: {wl.describe()}; SLOs {slo} for {args.goodput_target:.0%} of requests; "
          f"up to {args.plan_max_gpus} GPUs of {', '.join(hardware)}")

    def progress(ev: Any) -> None:
        if not args.no_progress:
            print(f"  {ev.deployment.label:<34} ${ev.deployment.price_per_hour:>7.2f}/h  "
                  f"goodput {ev.goodput_fraction:6.1%}", file=sys.stderr)

    try:
        res = plan(planner, wl, rate, hardware=hardware, tp_sizes=tp_sizes,
                   max_gpus=args.plan_max_gpus, target=args.goodput_target, modes=modes,
                   progress=progress)
    except ValueError as e:
        raise _fail(str(e)) from None
    rows = []
    for fam, ev in sorted(res.best.items(), key=lambda kv: (
            kv[1] is None, kv[1].deployment.price_per_hour if kv[1] else 0)):
        if ev is None:
            rows.append([fam, f"none within {args.plan_max_gpus} GPUs", "", "", "", "", "", ""])
            continue
        d, m = ev.deployment, ev.metrics
        rows.append([fam, d.label, str(d.num_gpus), f"{d.price_per_hour:.2f}",
                     f"{ev.goodput_fraction:.1%}", f"{ev.goodput_rps:.2f}",
                     f"{m['ttft_ms']['p90']:.0f}", f"{m['tpot_ms']['p90']:.1f}"])
    rich = not args.plain and sys.stdout.isatty()
    _print_rows(f"Cheapest fleet per family at {rate:g} req/s",
                ["family", "fleet", "GPUs", "$/h", "goodput", "good req/s", "p90 TTFT ms",
                 "p90 TPOT ms"], rows, rich)
    best = res.cheapest
    if best is None:
        print(f"no fleet within {args.plan_max_gpus} GPUs reaches {args.goodput_target:.0%} "
              "goodput: raise --plan-max-gpus or relax the SLOs")
    else:
        print(f"cheapest: {best.deployment.label} ({best.deployment.num_gpus} GPUs, "
              f"${best.deployment.price_per_hour:.2f}/h), goodput {best.goodput_fraction:.1%}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        doc = {"schema": "iterserve.sim.plan/v1", "rate": rate, "slos_ms": slo,
               "target": args.goodput_target,
               "best": {f: None if e is None else _ev_dict(e) for f, e in res.best.items()},
               "evaluated": [_ev_dict(e) for e in res.evaluated],
               "cheapest": None if best is None else best.deployment.label}
        written = [str(out / "plan.json")]
        if not args.no_plots:
            rates = ([float(x) for x in args.plan_rates.split(",") if x.strip()]
                     if args.plan_rates else [rate * f for f in (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0)])
            curves = {}
            for ev in (e for e in res.best.values() if e is not None):
                curves[ev.deployment.label] = [
                    (r, planner.evaluate(ev.deployment, workload_at(r), r).goodput_rps)
                    for r in rates]
            doc["curves"] = curves
            written.append(str(plot_goodput(curves, out / "plan.png", rate)))
        (out / "plan.json").write_text(json.dumps(doc, indent=1, default=float))
        print("wrote " + ", ".join(written))
    return 0


def _ev_dict(ev: Any) -> dict[str, Any]:
    d, m = ev.deployment, ev.metrics
    return {"label": d.label, "deployment": dataclasses.asdict(d), "num_gpus": d.num_gpus,
            "price_per_hour": d.price_per_hour, "power_w": d.power_w,
            "goodput_fraction": ev.goodput_fraction, "goodput_rps": ev.goodput_rps,
            "ttft_ms": m["ttft_ms"], "tpot_ms": m["tpot_ms"], "e2e_ms": m["e2e_ms"]}


def plot_goodput(curves: dict[str, list[tuple[float, float]]], path: Path, rate: float) -> Path:
    """Goodput (requests/s within the SLOs) against offered load, one line per fleet."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, pts in curves.items():
        ax.plot([r for r, _ in pts], [g for _, g in pts], marker="o", label=label)
    hi = max((r for pts in curves.values() for r, _ in pts), default=rate)
    ax.plot([0, hi], [0, hi], color="grey", lw=0.8, ls=":", label="offered load")
    ax.axvline(rate, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("offered load (req/s)")
    ax.set_ylabel("goodput (req/s within SLO)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
