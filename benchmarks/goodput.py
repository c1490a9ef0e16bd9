"""Goodput by scheduling policy, in the simulator (virtual clock, production scheduler).

Workloads (every request sends max_tokens 2048, as a client would; output lengths
are hidden from the scheduler and end by EOS):

- ``conv``, ``code``: the Splitwise conversation and coding traces (prompt and
  output lengths; Poisson arrivals at the load), the model preset's full KV cache;
- ``mix``: a synthetic mix, 85% short prompts (64-512 tokens, 32-256 out) and 15%
  long ones (3,000-7,000 tokens, 16-128 out) on a small KV cache (800 blocks of
  16 tokens), so long prompts wait for memory and block the queue under fcfs.

Loads are multiples of the capacity the cost model predicts (``stability_check``).
Model: Llama-2-7B roofline on an H100; max_num_seqs 128, a 512-token budget,
chunked prefill. Policies: fcfs, fcfs+backfill, sjf (prompt + max_tokens), aging
(sjf aged by waiting time), slo, slo+admission (slo refusing what it cannot
serve in time; a refused request counts as a miss).

SLOs come from the workload's unloaded latencies, by one rule for every workload:
TTFT target = 5 x p90 TTFT and TPOT target = 3 x p90 TPOT of fcfs at 0.1x load.
Goodput = requests meeting both targets per second of the run. "max wait" is the
longest time any request waited for its first token.

Each workload ends with a summary: the best fixed policy's goodput, the others' as a
multiple of it, and upper bounds on any policy's goodput (``upper_bounds``): a row
whose bound is under 1.3x the best fixed policy cannot reach 1.3x at all.

    python benchmarks/goodput.py [--quick] [--seed S] [--num-requests N] [--workloads conv,code,mix]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from iterserve.config import CacheConfig, SchedulerConfig
from iterserve.sim.cost_model import (
    HARDWARE_PRESETS,
    MODEL_PRESETS,
    kv_cache_blocks,
    roofline_cost_model,
)
from iterserve.sim.simulator import SimResult, Simulator, stability_check
from iterserve.sim.workload import RequestSpec, Workload, arrival_times, make_workload

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from results import BenchmarkRun

MAX_TOKENS = 2048
MIX_BLOCKS = 800
TTFT_FACTOR, TPOT_FACTOR = 5.0, 3.0
POLICIES = ("fcfs", "fcfs+backfill", "sjf", "aging", "slo", "slo+admission")
FIXED = ("fcfs", "fcfs+backfill", "sjf", "aging")


def mix_workload(n: int, rate: float, seed: int) -> Workload:
    rng = np.random.default_rng(seed)
    t = arrival_times(n, "poisson", rate, seed=seed)
    long = rng.random(n) < 0.15
    p = np.where(long, rng.integers(3000, 7001, n), rng.integers(64, 513, n))
    o = np.where(long, rng.integers(16, 129, n), rng.integers(32, 257, n))
    reqs = [RequestSpec(float(t[i]), int(p[i]), int(o[i]), max_tokens=MAX_TOKENS) for i in range(n)]
    return Workload(reqs, name="mix", meta={"rate": rate, "seed": seed})


def trace_workload(name: str, n: int, rate: float, seed: int) -> Workload:
    wl = make_workload(n, arrival="poisson", rate=rate, prompt_len="trace", output_len="trace",
                       trace=f"splitwise_{name}", seed=seed, name=name)  # shipped traces
    for r in wl.requests:
        r.max_tokens = MAX_TOKENS
    return wl


def build(workload: str, n: int, rate: float, seed: int = 0) -> Workload:
    return mix_workload(n, rate, seed) if workload == "mix" else trace_workload(workload, n, rate, seed)


def configs(workload: str, policy: str, cost, slo: tuple[float, float], mean_len: float):
    model, hw = MODEL_PRESETS["llama-2-7b"], HARDWARE_PRESETS["h100"]
    blocks = MIX_BLOCKS if workload == "mix" else kv_cache_blocks(model, hw, 16)
    base = policy.split("+")[0]
    kw: dict = {}
    if base == "aging":
        # One TTFT target of waiting is worth a mean-length job (prompt + max_tokens).
        kw = {"aging_base": "sjf", "aging_rate": mean_len / (slo[0] * 1e-3)}
    if base == "slo":
        kw = {"ttft_slo_ms": slo[0], "tpot_slo_ms": slo[1],
              "step_time_coefficients": (cost.t0, cost.prefill_token, cost.decode_seq,
                                         cost.context_token)}
    sc = SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=512, max_model_len=16384,
                         enable_chunked_prefill=True, scheduling_policy=base,
                         enable_backfill=policy.endswith("+backfill"),
                         slo_admission=policy.endswith("+admission"), **kw)
    return sc, CacheConfig(block_size=16, num_gpu_blocks=blocks)


def summarize(r: SimResult, slo: tuple[float, float]) -> dict[str, float]:
    done = ~np.isnan(r.finished)
    ttft = (r.first_token - r.arrival)[done]
    out = r.output_len[done].astype(np.float64)
    e2e = (r.finished - r.arrival)[done]
    tpot = np.where(out > 1, (e2e - ttft) / np.maximum(out - 1, 1), 0.0)
    duration = float(np.nanmax(r.finished) - r.arrival.min())
    ok = (ttft * 1e3 <= slo[0]) & (tpot * 1e3 <= slo[1])
    multi = out > 1
    return {
        "goodput": float(ok.sum()) / duration,
        "ttft_mean": float(ttft.mean()) * 1e3,
        "ttft_p50": float(np.percentile(ttft, 50)) * 1e3,
        "ttft_p99": float(np.percentile(ttft, 99)) * 1e3,
        "tpot_p99": float(np.percentile(tpot[multi], 99)) * 1e3 if multi.any() else 0.0,
        "max_wait": float(ttft.max()),
        "completed": float(done.sum()) / len(r.arrival),
    }


def upper_bounds(wl: Workload, cost, budget: int) -> tuple[float, float]:
    """Goodput no policy can beat on ``wl`` (requests/s over the arrival span):

    - offered: every request on time, finishing as it arrives (n / span);
    - work: the most requests whose tokens (prompt + output - 1 each) the machine can
      run within the span, cheapest first, at its best token rate (full
      ``budget``-token steps, context free). A schedule that serves every request
      (no refusals) is bounded tighter still: n over the time all of the work takes.
    """
    arr = np.array([r.arrival_time for r in wl.requests])
    span = float(arr.max() - arr.min())
    w = np.sort(np.array([r.prompt_len + max(r.output_len, 1) - 1 for r in wl.requests]))
    rate = budget / (cost.t0 + budget * min(cost.prefill_token, cost.decode_seq))
    k = int(np.searchsorted(np.cumsum(w), rate * span, side="right"))
    return len(w) / span, k / span


def run(workload: str, policy: str, load: float, n: int, cost, slo, cap: float, mean_len: float,
        seed: int = 0):
    sc, cc = configs(workload, policy, cost, slo, mean_len)
    wl = build(workload, n, load * cap, seed)
    res = Simulator(sc, cc, cost, record_itl=False).run(wl)
    out = summarize(res, slo)
    out["refused"] = res.num_rejected / len(wl)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer requests and loads")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--workloads", default="conv,code,mix")
    ap.add_argument("--loads", default=None, help="comma list (default 0.5,0.8,1.0,1.15,1.3)")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help="comma list of " + ", ".join(POLICIES))
    ap.add_argument("--seed", type=int, default=0, help="arrivals and lengths")
    args = ap.parse_args()
    n = args.num_requests or (400 if args.quick else 1500)
    loads = [float(x) for x in (args.loads or ("0.5,1.0,1.3" if args.quick else
                                               "0.5,0.8,1.0,1.15,1.3")).split(",")]
    policies = args.policies.split(",")
    model, hw = MODEL_PRESETS["llama-2-7b"], HARDWARE_PRESETS["h100"]
    cost = roofline_cost_model(model, hw, 16)
    t0 = time.perf_counter()
    rec = BenchmarkRun("goodput", "Goodput by scheduling policy (simulator)", [
        "src/iterserve/core", "src/iterserve/sim", "benchmarks/goodput.py"]).start()
    print(f"# Goodput by policy (simulator; llama-2-7b roofline on H100; {n} requests per run)\n")
    for w in args.workloads.split(","):
        probe = build(w, n, 1.0, args.seed)
        sc, cc = configs(w, "fcfs", cost, (1.0, 1.0), 1.0)
        cap = stability_check(probe, cost, sc, cc).capacity_requests_per_s
        mean_len = probe.mean_prompt_len + MAX_TOKENS
        unloaded = Simulator(sc, cc, cost, record_itl=False).run(build(w, n, 0.1 * cap, args.seed))
        base = summarize(unloaded, (np.inf, np.inf))
        done = ~np.isnan(unloaded.finished)
        ttft = (unloaded.first_token - unloaded.arrival)[done]
        out = unloaded.output_len[done].astype(np.float64)
        e2e = (unloaded.finished - unloaded.arrival)[done]
        m = out > 1
        tpot = (e2e[m] - ttft[m]) / (out[m] - 1)
        slo = (TTFT_FACTOR * float(np.percentile(ttft, 90)) * 1e3,
               TPOT_FACTOR * float(np.percentile(tpot, 90)) * 1e3)
        print(f"## {w}: {probe.describe()}")
        print(f"predicted capacity {cap:.2f} req/s; unloaded (0.1x) TTFT p50 {base['ttft_p50']:.0f} ms;"
              f" SLOs: TTFT {slo[0]:.0f} ms, TPOT {slo[1]:.1f} ms\n")
        print("| load | policy | goodput req/s | mean TTFT ms | p50 TTFT ms | p99 TTFT ms "
              "| p99 TPOT ms | max wait s | refused |")
        print("|---|---|---|---|---|---|---|---|---|")
        summary = []
        for load in loads:
            good = {}
            for p in policies:
                s = run(w, p, load, n, cost, slo, cap, mean_len, args.seed)
                good[p] = s["goodput"]
                rec.figure("goodput req/s", s["goodput"], unit="req/s", better="higher",
                           workload=w, load=load, policy=p, requests=n)
                for q in ("p50", "p99"):
                    rec.figure(f"TTFT {q}", s[f"ttft_{q}"], unit="ms", better="lower", workload=w,
                               load=load, policy=p, requests=n)
                print(f"| {load:.2f} | {p} | {s['goodput']:.2f} | {s['ttft_mean']:.0f} | "
                      f"{s['ttft_p50']:.0f} | {s['ttft_p99']:.0f} | {s['tpot_p99']:.1f} | "
                      f"{s['max_wait']:.1f} | {s['refused']:.0%} |", flush=True)
            summary.append((load, good, upper_bounds(build(w, n, load * cap, args.seed), cost,
                                                     sc.max_num_batched_tokens)))
        fixed = [p for p in policies if p in FIXED]
        if fixed:
            print("\n| load | best fixed | goodput | " + " | ".join(
                f"{p} / best" for p in policies if p not in FIXED)
                + " | bound: offered | bound: work | bound / best |")
            print("|---|---|---|" + "---|" * (len(policies) - len(fixed)) + "---|---|---|")
            for load, good, (offered, work) in summary:
                best = max(fixed, key=lambda p: good[p])
                g = good[best]
                ratios = " | ".join(f"{good[p] / g:.2f}x" for p in policies if p not in FIXED)
                print(f"| {load:.2f} | {best} | {g:.2f} | {ratios} | {offered:.2f} | {work:.2f} | "
                      f"{min(offered, work) / g:.2f}x |")
                labels = {"workload": w, "load": load, "requests": n}
                for p in policies:
                    if p in FIXED:
                        continue
                    rec.figure(f"goodput req/s, {p}", good[p], unit="req/s", better="higher",
                               headline=load in (1.0, 1.3), **labels)
                    rec.baseline(f"best fixed policy ({best})", f"goodput req/s, {p}", g,
                                 unit="req/s", better="higher", **labels)
                rec.figure("upper bound on any policy's goodput", min(offered, work),
                           unit="req/s", system="bound", **labels)
        print()
    print(f"(wall {time.perf_counter() - t0:.0f} s)")
    rec.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
