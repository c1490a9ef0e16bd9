"""Prefill/decode disaggregation against colocated serving, in the simulator: the anchors
of Splitwise (ISCA'24) and DistServe (OSDI'24) on the shipped Splitwise traces.

Simulation only (virtual clock, deterministic for a seed; not a timing measurement).
Model: Llama-2-70B (bf16) on DGX-A100 / DGX-H100 machines, one replica per machine at
tensor parallel size 8, as both papers ran it; roofline cost models
(``roofline_cost_model``, the all-reduces priced over NVLink); every replica the
production scheduler; routers: cache-aware for prefill and colocated replicas,
``least_kv`` for decode replicas; KV over a 400 Gb/s link per prefill machine (+1 ms).
Prices and power: the hardware presets' (Splitwise's machine prices over 8 GPUs; TDP).

Designs (Splitwise's names): Baseline-A100 / Baseline-H100 (colocated; with chunked
prefill, a 2,048-token budget as vLLM V1's, and without it, prefill first as the vLLM
the papers compared against), Splitwise-AA / -HH / -HA (prefill machines of the first
kind, decode machines of the second).

Method, per trace and SLO pair (a request meets it when its TTFT and its TPOT are both
within; a fleet meets the target when 90% of requests do):

1. per-machine capacity: the highest Poisson rate (bisection) one machine sustains
   within the SLOs, as a colocated replica, as the prefill pool (1 prefill machine, 8
   decode DGX-H100s) and as the decode pool (1 decode machine, 8 prefill DGX-H100s);
2. iso-cost: within a budget (``--budget-machines`` DGX-H100s), each design's best
   split from those capacities, then simulated whole at that rate (lowered by 5%
   steps until it meets the target): its throughput within the SLOs, per $ and per GPU;
3. iso-throughput: the cheapest fleet of each design for Baseline-H100's rate.

    python benchmarks/pd_simulation.py [--traces splitwise_conv,splitwise_code] [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from iterserve.config import CacheConfig, SchedulerConfig
from iterserve.sim.disagg import KVLink
from iterserve.sim.plan import Deployment, Planner, max_rate
from iterserve.sim.roofline import (
    get_hardware,
    get_model_spec,
    kv_cache_blocks,
    roofline_cost_model,
)
from iterserve.sim.workload import make_workload

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import BenchmarkRun

MODEL = get_model_spec("llama-2-70b")
TP = 8
TARGET = 0.9
# Per trace: (TTFT ms, TPOT ms): about 5x an unloaded DGX-H100's TPOT, and a TTFT that
# an unloaded DGX-A100 meets for 90% of the trace's prompts (the code trace's are ~2x
# longer).
SLOS = {"splitwise_conv": (500.0, 50.0), "splitwise_code": (1000.0, 50.0),
        "summarization_long": (1000.0, 50.0)}
DESIGNS = {"Splitwise-AA": ("a100", "a100"), "Splitwise-HH": ("h100", "h100"),
           "Splitwise-HA": ("h100", "a100")}
# Published (not measured here).
SPLITWISE_SRC = ("Patel et al., Splitwise: Efficient Generative LLM Inference Using Phase "
                 "Splitting, ISCA 2024, abstract (Llama-2-70B and BLOOM-176B on DGX-A100/H100)")
DISTSERVE_SRC = ("Zhong et al., DistServe: Disaggregating Prefill and Decoding for Goodput-"
                 "optimized LLM Serving, OSDI 2024, abstract (OPT-13B..175B on A100s, vs vLLM)")


def scheduler(chunked: bool, budget: int = 2048) -> SchedulerConfig:
    if chunked:
        return SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=budget,
                               max_model_len=16384, enable_chunked_prefill=True)
    return SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=16384, max_model_len=16384,
                           enable_chunked_prefill=False)


def make_planner(slos: dict[str, float], chunked: bool) -> Planner:
    def pools(h: str, tp: int):
        hw = get_hardware(h)
        blocks = kv_cache_blocks(MODEL, hw, tensor_parallel_size=tp)
        return (roofline_cost_model(MODEL, hw, 16, tp), scheduler(chunked),
                CacheConfig(block_size=16, num_gpu_blocks=blocks))
    return Planner(pools, MODEL.kv_bytes_per_token, KVLink(400.0, 1e-3), slos)


@dataclass
class Capacities:
    colocated: dict[str, float]
    colocated_unchunked: dict[str, float]
    prefill: dict[str, float]
    decode: dict[str, float]


def machine_price(h: str) -> float:
    return TP * get_hardware(h).price_per_hour


def best_split(ph: str, dh: str, cap: Capacities, budget: float) -> tuple[int, int, float]:
    """Prefill and decode machines within ``budget`` $/h maximising min(P cp, D cd)."""
    best = (0, 0, 0.0)
    p = 1
    while p * machine_price(ph) < budget:
        d = int((budget - p * machine_price(ph) + 1e-9) // machine_price(dh))
        if d >= 1:
            r = min(p * cap.prefill[ph], d * cap.decode[dh])
            if r > best[2]:
                best = (p, d, r)
        p += 1
    return best


def cheapest_split(ph: str, dh: str, cap: Capacities, rate: float) -> tuple[int, int, float]:
    """The fewest machines of each pool whose capacities cover ``rate`` (inf: a pool
    that meets the SLOs at no rate)."""
    if not (cap.prefill[ph] and cap.decode[dh]):
        return 0, 0, float("inf")
    p, d = -(-rate // cap.prefill[ph]), -(-rate // cap.decode[dh])
    return int(p), int(d), p * machine_price(ph) + d * machine_price(dh)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", default="splitwise_conv,splitwise_code")
    ap.add_argument("--budget-machines", type=int, default=8,
                    help="iso-cost budget, in DGX-H100 machines (default 8)")
    ap.add_argument("--num-requests", type=int, default=800,
                    help="requests per capacity run (default 800)")
    ap.add_argument("--seconds", type=float, default=60.0,
                    help="simulated seconds of arrivals in a fleet run (default 60)")
    ap.add_argument("--slo-ttft-ms", type=float, default=None, help="override the trace's TTFT SLO")
    ap.add_argument("--slo-tpot-ms", type=float, default=None, help="override the trace's TPOT SLO")
    ap.add_argument("--machines", default="a100,h100", help="GPU kinds (default a100,h100)")
    ap.add_argument("--quick", action="store_true", help="smoke run: few requests, coarse search")
    args = ap.parse_args()
    n_cap = 120 if args.quick else args.num_requests
    iters = 2 if args.quick else 6
    seconds = 8.0 if args.quick else args.seconds
    budget = args.budget_machines * machine_price("h100")
    traces = [t.strip() for t in args.traces.split(",") if t.strip()]
    kinds = [h.strip() for h in args.machines.split(",") if h.strip()]
    if "h100" not in kinds:
        raise SystemExit("--machines must include h100 (the baseline and the oversized pools)")
    designs = {k: v for k, v in DESIGNS.items() if set(v) <= set(kinds)}

    rec = BenchmarkRun("pd_simulation", "Prefill/decode disaggregation (simulator)",
                       ["src/iterserve/sim", "src/iterserve/core", "src/iterserve/cluster/routing.py",
                        "src/iterserve/cluster/cache_aware.py", "benchmarks/pd_simulation.py"]).start()
    rec.note("simulation only: deterministic figures of the roofline cost model, not timings")
    rec.reference("Splitwise", "throughput at 20% lower cost vs baseline", 1.4, unit="x",
                  source=SPLITWISE_SRC)
    rec.reference("Splitwise", "throughput at the same cost and power vs baseline", 2.35,
                  unit="x", source=SPLITWISE_SRC)
    rec.reference("DistServe", "requests served within SLO vs vLLM", 7.4, unit="x",
                  source=DISTSERVE_SRC)
    rec.reference("DistServe", "tighter SLO at the same attainment vs vLLM", 12.6, unit="x",
                  source=DISTSERVE_SRC)
    t_start = time.perf_counter()
    for trace in traces:
        ttft, tpot = SLOS.get(trace, (500.0, 50.0))
        ttft = args.slo_ttft_ms or ttft
        tpot = args.slo_tpot_ms or tpot
        slos = {"ttft": ttft, "tpot": tpot}
        pl = make_planner(slos, chunked=True)
        pl_nc = make_planner(slos, chunked=False)

        def workload_at(rate: float, n: int | None = None, trace: str = trace):
            return make_workload(n or n_cap, arrival="poisson", rate=rate, prompt_len="trace",
                                 output_len="trace", trace=trace, seed=0)

        def fleet_workload(rate: float, trace: str = trace):
            return workload_at(rate, max(n_cap, min(int(rate * seconds), 6000)), trace)

        def cap_of(planner: Planner, dep: Deployment) -> float:
            r, _ = max_rate(planner, dep, workload_at, TARGET, 0.25, 120.0, iters=iters + 2)
            return r

        print(f"\n== {trace}: SLO TTFT <= {ttft:g} ms and TPOT <= {tpot:g} ms for "
              f"{TARGET:.0%} of requests; Llama-2-70B, TP {TP} per machine ==", flush=True)
        cap = Capacities({}, {}, {}, {})
        for h in kinds:
            cap.colocated[h] = cap_of(pl, Deployment.colocated(h, TP, 1))
            cap.colocated_unchunked[h] = cap_of(pl_nc, Deployment.colocated(h, TP, 1))
            # The other pool oversized (8 H100s): only this one can be the bottleneck.
            cap.prefill[h] = cap_of(pl, Deployment.disaggregated(h, TP, 1, "h100", TP, 8))
            cap.decode[h] = cap_of(pl, Deployment.disaggregated("h100", TP, 8, h, TP, 1))
        print("per-machine capacity within the SLOs (req/s):")
        print("| machine | colocated, chunked | colocated, no chunking | as prefill | as decode |")
        print("|---|---|---|---|---|")
        for h in kinds:
            print(f"| DGX-{h.upper()} | {cap.colocated[h]:.2f} | {cap.colocated_unchunked[h]:.2f} "
                  f"| {cap.prefill[h]:.2f} | {cap.decode[h]:.2f} |")
            for kind, v in (("colocated", cap.colocated[h]),
                            ("colocated, no chunking", cap.colocated_unchunked[h]),
                            ("prefill", cap.prefill[h]), ("decode", cap.decode[h])):
                rec.figure("per-machine capacity within SLO", v, unit="req/s", better="higher",
                           trace=trace, machine=f"DGX-{h.upper()}", role=kind)

        # Iso-cost: each design at its best split within the budget, simulated whole.
        plans: list[tuple[str, Planner, Deployment, float]] = []
        for h in kinds:
            n = int((budget + 1e-9) // machine_price(h))
            plans.append((f"Baseline-{h.upper()}", pl, Deployment.colocated(h, TP, n),
                          n * cap.colocated[h]))
            plans.append((f"Baseline-{h.upper()} (no chunking)", pl_nc,
                          Deployment.colocated(h, TP, n), n * cap.colocated_unchunked[h]))
        for name, (ph, dh) in designs.items():
            p, d, r = best_split(ph, dh, cap, budget)
            if p:
                plans.append((name, pl, Deployment.disaggregated(ph, TP, p, dh, TP, d), r))
        rows = []
        for name, planner, dep, est in plans:
            rate, ev = est, None
            if rate <= 0:
                rows.append((name, dep, 0.0, None))
                continue
            for _ in range(1 if args.quick else 6):
                ev = planner.evaluate(dep, fleet_workload(rate), rate)
                if ev.goodput_fraction >= TARGET:
                    break
                rate *= 0.95
            ok = ev is not None and ev.goodput_fraction >= TARGET
            rows.append((name, dep, rate if ok else 0.0, ev))
        base = {r[0]: r for r in rows}
        ref = base["Baseline-H100"][2] / base["Baseline-H100"][1].price_per_hour or 1e-12
        ref_nc = (base["Baseline-H100 (no chunking)"][2]
                  / base["Baseline-H100 (no chunking)"][1].price_per_hour) or 1e-12
        print(f"\niso-cost: within ${budget:.0f}/h ({args.budget_machines} DGX-H100):")
        print("| design | machines | $/h | kW | throughput within SLO (req/s) | goodput | "
              "req/s per $/h vs Baseline-H100 | vs Baseline-H100 (no chunking) | "
              "req/s per GPU |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name, dep, rate, ev in rows:
            per_dollar = rate / dep.price_per_hour
            print(f"| {name} | {dep.label} | {dep.price_per_hour:.1f} | {dep.power_w / 1e3:.1f} "
                  f"| {rate:.2f} | {ev.goodput_fraction if ev else 0:.1%} | {per_dollar / ref:.2f}x "
                  f"| {per_dollar / ref_nc:.2f}x | {rate / dep.num_gpus:.3f} |")
            labels = dict(trace=trace, design=name, fleet=dep.label, budget_usd_h=round(budget, 1),
                          slo_ttft_ms=ttft, slo_tpot_ms=tpot)
            rec.figure("throughput within SLO, iso-cost", rate, unit="req/s", better="higher",
                       headline=name == "Splitwise-HA", **labels)
            rec.figure("throughput per $/h vs Baseline-H100", per_dollar / ref, unit="x",
                       better="higher", **labels)
            rec.figure("goodput per GPU", rate / dep.num_gpus, unit="req/s/GPU",
                       better="higher", **labels)

        # Iso-throughput: Baseline-H100's rate, each design's cheapest fleet (from the
        # per-machine capacities).
        target_rate = base["Baseline-H100"][2]
        print(f"\niso-throughput: the cheapest fleet for {target_rate:.2f} req/s (from the "
              "per-machine capacities):")
        print("| design | machines | $/h | cost vs Baseline-H100 |")
        print("|---|---|---|---|")
        h100_cost = -(-target_rate // cap.colocated["h100"]) * machine_price("h100") or 1e-12
        for h in kinds:
            for label, c in ((f"Baseline-{h.upper()}", cap.colocated[h]),
                             (f"Baseline-{h.upper()} (no chunking)", cap.colocated_unchunked[h])):
                n = -(-target_rate // c) if c else 0
                cost = n * machine_price(h) if c else float("nan")
                if not c:
                    print(f"| {label} | none meets the SLOs | | |")
                    continue
                print(f"| {label} | {int(n)} x {h}x{TP} | {cost:.1f} | {cost / h100_cost:.2f} |")
        for name, (ph, dh) in designs.items():
            p, d, cost = cheapest_split(ph, dh, cap, target_rate)
            print(f"| {name} | {p}P {ph}x{TP} + {d}D {dh}x{TP} | {cost:.1f} | "
                  f"{cost / h100_cost:.2f} |")
            rec.figure("cost for Baseline-H100's throughput", cost / h100_cost, unit="x",
                       better="lower", trace=trace, design=name)
        print(f"(elapsed {time.perf_counter() - t_start:.0f} s)", flush=True)
    if args.quick:
        rec.discard()
    else:
        rec.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
