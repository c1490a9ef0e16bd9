"""Routing policies over N replicas, in the simulator (virtual clock, production engines,
the routing policy objects a served cluster uses).

Workloads (``iterserve.measure``'s generators, seeded):

- ``multi-turn``: chat sessions over per-tenant system prompts (16 tenants x 2,048
  tokens; 2-8 turns of 64-512 new user tokens and 64-512 answer tokens; 5 s mean
  think time). Each replica's KV cache is sized from the workload's own working set
  W (the system prompts plus the conversations of the sessions alive at a moment,
  averaged over the run): ``num_gpu_blocks = 2 W / N``, so one replica holds half
  (4 replicas) or a quarter (8) of it and the cluster twice it.
- ``control``: the same lengths and load with no shared prefix at all (independent
  single-turn prompts): cache-aware routing has nothing to win and must come out
  within noise of round-robin.
- ``one-hot``: every request opens with the same 2,048-token prefix (one tenant,
  single turns): a router that follows the prefix alone would pile everything on one
  replica; the requests must still spread (``imbalance`` = busiest replica's
  requests / the mean; 1.00 is an even split).

Load: ``--load`` x the cluster's capacity as the cost model predicts it *without*
prefix caching (``stability_check`` per replica x N), so above 1 only a policy that
makes the cache pay keeps up. Model: Llama-2-7B roofline on an H100; max_num_seqs 128,
a 2,048-token budget, chunked prefill. Router stats: fresh at every decision, and for
``cache_aware@1s`` polled every simulated second (as a Ray Serve router's).
Goodput: requests per second whose TTFT meets the SLO (``--ttft-slo-ms``).

    python benchmarks/routing.py [--quick] [--replicas 4,8] [--loads 0.7,1.5]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import numpy as np

from iterserve.config import CacheConfig, SchedulerConfig
from iterserve.sim.cluster import ClusterSimulator, cluster_metrics
from iterserve.sim.cost_model import CostModel, get_hardware, get_model_spec, roofline_cost_model
from iterserve.sim.simulator import stability_check
from iterserve.sim.workload import (
    MultiTurnConfig,
    RequestSpec,
    Workload,
    make_multi_turn_workload,
)

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from results import BenchmarkRun

BLOCK = 16
POLICIES = ("round_robin", "least_loaded", "power_of_two", "cache_aware", "cache_aware@1s",
            "cache_aware:load_weight=256")
MULTI_TURN = MultiTurnConfig(num_tenants=16, system_prompt_len=2048, turns="uniform:2:8",
                             user_len="uniform:64:512", output_len="uniform:64:512",
                             think_time_s=5.0, est_tpot_s=0.02)


def scheduler_config() -> SchedulerConfig:
    return SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=2048, max_model_len=32768,
                           enable_chunked_prefill=True)


def working_set_blocks(wl: Workload, num_points: int = 20) -> float:
    """Mean KV blocks the live sessions' prefixes span: every tenant's system prompt
    once, plus each session alive at a moment (first turn arrived, last not yet) at its
    latest prompt + answer beyond the system prompt; averaged over the run's middle."""
    sessions: dict[str, list[RequestSpec]] = {}
    for r in wl.requests:
        sessions.setdefault(r.session_id or "", []).append(r)
    sys_len = int(wl.meta.get("system_prompt_len", 0) or 0)
    tenants = {r.tenant for r in wl.requests}
    t_end = wl.requests[-1].arrival_time
    total = 0.0
    for t in np.linspace(0.25 * t_end, 0.75 * t_end, num_points):
        tokens = 0
        for turns in sessions.values():
            if turns[0].arrival_time <= t <= turns[-1].arrival_time:
                last = max((r for r in turns if r.arrival_time <= t), key=lambda r: r.arrival_time)
                tokens += last.prompt_len + last.output_len - sys_len
        total += tokens / BLOCK + len(tenants) * sys_len / BLOCK
    return total / num_points


def size_cluster(n: int, n_rep: int, load: float, cost: CostModel,
                 seed: int) -> tuple[Workload, float, int, float]:
    """The multi-turn workload at ``load`` x the cluster's no-cache capacity, its working
    set W and ``2 W / n_rep`` blocks per replica. Capacity depends on the KV cache and
    W on the rate, so both are iterated to a fixed point (a few rounds)."""
    sc = scheduler_config()
    wl = make_multi_turn_workload(n, MULTI_TURN, rate=1.0, seed=seed)
    blocks = 1 << 20
    cap = w = 0.0
    for _ in range(4):
        kv = CacheConfig(block_size=BLOCK, num_gpu_blocks=blocks)
        cap = stability_check(wl, cost, sc, kv).capacity_requests_per_s * n_rep
        wl = make_multi_turn_workload(n, MULTI_TURN, rate=load * cap, seed=seed)
        w = working_set_blocks(wl)
        blocks = int(2 * w / n_rep)
    return wl, w, blocks, cap


def control_workload(wl: Workload, seed: int) -> Workload:
    """``wl``'s arrivals and lengths, every prompt fresh random tokens (no sharing)."""
    rng = np.random.default_rng(seed)
    reqs = [dataclasses.replace(
        r, prompt_token_ids=rng.integers(8, 32000, size=r.prompt_len).tolist(),
        session_id=None) for r in wl.requests]
    return Workload(reqs, name="control", meta=dict(wl.meta, workload="control"))


def one_hot_workload(n: int, rate: float, seed: int) -> Workload:
    cfg = dataclasses.replace(MULTI_TURN, num_tenants=1, turns="fixed:1")
    return make_multi_turn_workload(n, cfg, rate=rate, seed=seed, name="one-hot")


def run_policy(wl: Workload, policy: str, n_rep: int, blocks: int, cost: CostModel,
               slo_ms: float) -> dict:
    """``policy``: ``NAME[@PERIODs][:OPTION=VALUE]`` (stats polled every PERIOD
    seconds; one numeric policy option)."""
    spec, _, option = policy.partition(":")
    name, _, period = spec.partition("@")
    stats_period = float(period.rstrip("s")) if period else 0.0
    options = {}
    if option:
        key, _, value = option.partition("=")
        options[key] = float(value)
    sim = ClusterSimulator(scheduler_config(), CacheConfig(block_size=BLOCK, num_gpu_blocks=blocks),
                           cost, num_replicas=n_rep, router_policy=name, policy_options=options,
                           stats_period_s=stats_period, label=policy)
    return cluster_metrics(sim.run(wl), {"ttft": slo_ms})


def table(title: str, rows: list[tuple[str, dict]]) -> str:
    base = rows[0][1]["output_token_throughput"]
    out = [f"**{title}**", "",
           "| policy | prefix hit rate | TTFT p50 (ms) | TTFT p90 (ms) | output tok/s | vs round_robin "
           "| goodput (req/s) | imbalance |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for label, m in rows:
        out.append(
            f"| {label} | {m['prefix_cache_hit_rate']:.1%} | {m['ttft_ms']['median']:,.0f} | "
            f"{m['ttft_ms']['p90']:,.0f} | {m['output_token_throughput']:,.0f} | "
            f"{m['output_token_throughput'] / base:.2f}x | "
            f"{m['goodput']['requests_per_s']:.2f} | {m['replica_imbalance']:.2f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests, 4 replicas, one load")
    ap.add_argument("--replicas", default="4,8")
    ap.add_argument("--loads", default="0.7,1.5", help="x the no-cache cluster capacity")
    ap.add_argument("--num-requests", type=int, default=None, help="per replica (default 500)")
    ap.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--workloads", default="multi-turn,control,one-hot")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    replicas = [4] if args.quick else [int(x) for x in args.replicas.split(",")]
    loads = [0.7] if args.quick else [float(x) for x in args.loads.split(",")]
    per_replica = args.num_requests or (100 if args.quick else 500)
    policies = args.policies.split(",")
    cost = roofline_cost_model(get_model_spec("llama-2-7b"), get_hardware("h100"), BLOCK)
    sc = scheduler_config()
    print(f"cost model: {cost.name}; max_num_seqs {sc.max_num_seqs}, budget "
          f"{sc.max_num_batched_tokens}, block {BLOCK}; TTFT SLO {args.ttft_slo_ms:.0f} ms\n")
    wall0 = time.perf_counter()
    rec = BenchmarkRun("routing", "Routing over replicas (simulator)", [
        "src/iterserve/cluster", "src/iterserve/sim", "src/iterserve/core",
        "benchmarks/routing.py"]).start()
    for n_rep in replicas:
        n = per_replica * n_rep
        for load in loads:
            wl, w, blocks, cap = size_cluster(n, n_rep, load, cost, args.seed)
            rate = load * cap
            print(f"## {n_rep} replicas, load {load:g} ({rate:.1f} req/s; no-cache capacity "
                  f"{cap:.1f} req/s)\n")
            print(f"working set {w:,.0f} blocks; {blocks:,} blocks per replica "
                  f"({blocks / w:.2f} W each, {n_rep * blocks / w:.1f} W in all)\n")
            work = [("multi-turn", wl), ("control", control_workload(wl, args.seed)),
                    ("one-hot", one_hot_workload(n, rate, args.seed))]
            for name, wk in work:
                if name not in args.workloads.split(","):
                    continue
                rows = [(p, run_policy(wk, p, n_rep, blocks, cost, args.ttft_slo_ms))
                        for p in policies]
                print(table(f"{name}: {wk.describe()}", rows) + "\n")
                record(rec, rows, workload=name, replicas=n_rep, load=load, requests=n)
    print(f"(simulated in {time.perf_counter() - wall0:.0f} s of wall time)")
    rec.finish()


def record(rec: BenchmarkRun, rows: list[tuple[str, dict]], **labels: object) -> None:
    """Every policy's figures; each policy beside round_robin (the baseline)."""
    def figures(m: dict) -> list[tuple[str, float, str, str | None]]:
        return [("output tok/s", m["output_token_throughput"], "tok/s", "higher"),
                ("TTFT p50", m["ttft_ms"]["median"], "ms", "lower"),
                ("TTFT p99", m["ttft_ms"]["p99"], "ms", "lower"),
                ("goodput req/s", m["goodput"]["requests_per_s"], "req/s", "higher"),
                ("prefix cache hit rate", m["prefix_cache_hit_rate"], "", "higher"),
                ("replica imbalance", m["replica_imbalance"], "", None)]
    base = dict(rows).get("round_robin")
    for policy, m in rows:
        if policy == "round_robin":
            continue
        for name, value, unit, better in figures(m):
            rec.figure(f"{name}, {policy}", value, unit=unit, better=better,
                       headline=policy == "cache_aware" and name != "replica imbalance",
                       **labels)
        if base is not None:
            for name, value, unit, better in figures(base):
                rec.baseline("round_robin router", f"{name}, {policy}", value, unit=unit,
                             better=better, **labels)


if __name__ == "__main__":
    main()
