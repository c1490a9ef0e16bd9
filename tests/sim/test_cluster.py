"""The multi-replica simulator: one replica is the single-engine simulator, every request
ends exactly once, the policies route as they say, stats can be stale."""

from __future__ import annotations

import json

import numpy as np
import pytest

from iterserve.config import CacheConfig, SchedulerConfig
from iterserve.entrypoints.cli import main
from iterserve.sim.cluster import ClusterSimulator, cluster_metrics
from iterserve.sim.cost_model import CostModel
from iterserve.sim.simulator import Simulator, compute_metrics
from iterserve.sim.workload import MultiTurnConfig, make_multi_turn_workload, make_workload

COST = CostModel(t0=5e-3, prefill_token=2e-5, decode_seq=3e-5, context_token=2e-7, swap_block=2e-4)
SC = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512, max_model_len=8192)
MT = MultiTurnConfig(num_tenants=4, system_prompt_len=512, turns="uniform:2:6",
                     user_len="uniform:16:128", output_len="uniform:16:96", think_time_s=2.0,
                     est_tpot_s=0.01)


def cache(blocks: int) -> CacheConfig:
    return CacheConfig(block_size=16, num_gpu_blocks=blocks)


@pytest.mark.parametrize("kind", ["synthetic", "multi-turn"])
def test_one_replica_equals_the_single_engine_simulator(kind):
    if kind == "synthetic":
        wl = make_workload(150, rate=30.0, prompt_len="uniform:8:300",
                           output_len="lognormal:40:1.0:400", seed=2)
    else:
        wl = make_multi_turn_workload(150, MT, rate=20.0, seed=2)
    cc = cache(120)  # small: preemptions and evictions happen too
    single = Simulator(SC, cc, COST).run(wl)
    cluster = ClusterSimulator(SC, cc, COST, num_replicas=1, router_policy="cache_aware").run(wl)
    assert single.num_preemptions_total > 0
    for name in ("arrival", "first_scheduled", "first_token", "finished", "prompt_len",
                 "output_len", "num_preemptions", "itl", "step_time", "step_dt",
                 "step_running", "step_waiting", "step_batch", "step_kv_usage"):
        assert np.array_equal(getattr(single, name), getattr(cluster, name), equal_nan=True), name
    assert (single.prefix_cache_queries, single.prefix_cache_hits) == (
        cluster.prefix_cache_queries, cluster.prefix_cache_hits)
    a, b = compute_metrics(single), cluster_metrics(cluster)
    assert a["ttft_ms"] == b["ttft_ms"] and a["prefix_cache_hit_rate"] == b["prefix_cache_hit_rate"]


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "power_of_two", "cache_aware"])
def test_every_request_ends_exactly_once(policy):
    wl = make_multi_turn_workload(200, MT, rate=40.0, seed=3)
    # One prompt longer than the context: the replica refuses it, and it still ends once.
    wl.requests[5].prompt_token_ids = list(range(8, 8 + 9000))
    wl.requests[5].prompt_len = 9000
    sim = ClusterSimulator(SC, cache(150), COST, num_replicas=3, router_policy=policy)
    res = sim.run(wl)
    assert res.num_rejected == 1
    ids = {str(i) for i in range(len(wl))}
    assert set(sim.finish_counts) == ids and set(sim.finish_counts.values()) == {1}
    assert set(sim.routed_to) == ids
    assert not np.isnan(res.finished).any() and len(res.finished) == len(wl) - 1
    assert sum(x["num_requests"] for x in res.replicas) == len(wl) - 1
    assert sim.policy is not None and set(sim.policy.outstanding.values()) <= {0}


def test_round_robin_splits_evenly():
    wl = make_workload(301, rate=50.0, prompt_len="uniform:16:200", output_len="fixed:20", seed=1)
    sim = ClusterSimulator(SC, cache(4096), COST, num_replicas=4, router_policy="round_robin")
    res = sim.run(wl)
    counts = [x["num_requests"] for x in res.replicas]
    assert sorted(counts) == [75, 75, 75, 76]
    # In turn: request i goes to replica i mod 4.
    assert all(sim.routed_to[str(i)] == f"replica-{i % 4}" for i in range(len(wl)))


def test_cache_aware_raises_the_hit_rate_on_multi_turn_sessions():
    wl = make_multi_turn_workload(400, MT, rate=30.0, seed=4)
    # Each replica holds a few sessions' conversations, the cluster many more.
    rates = {}
    for policy in ("round_robin", "cache_aware"):
        res = ClusterSimulator(SC, cache(600), COST, num_replicas=4, router_policy=policy).run(wl)
        rates[policy] = cluster_metrics(res)["prefix_cache_hit_rate"]
    assert rates["cache_aware"] > rates["round_robin"] + 0.05


def test_one_hot_prefix_still_spreads_over_replicas():
    # Every request shares one 1,024-token prefix, at a rate one replica cannot serve.
    wl = make_workload(400, rate=200.0, prompt_len="fixed:1100", output_len="fixed:64", seed=5)
    for r in wl.requests:
        r.prefix_group, r.prefix_len = 0, 1024
    res = ClusterSimulator(SC, cache(4096), COST, num_replicas=4,
                           router_policy="cache_aware").run(wl)
    counts = [x["num_requests"] for x in res.replicas]
    assert min(counts) > 0.15 * len(wl)


def test_stale_stats_are_polled_every_period():
    wl = make_multi_turn_workload(200, MT, rate=30.0, seed=6)
    sim = ClusterSimulator(SC, cache(300), COST, num_replicas=2, router_policy="cache_aware",
                           stats_period_s=0.5)
    res = sim.run(wl)
    polls = sim.poll_times
    assert polls[0] == 0.0 and np.allclose(np.diff(polls), 0.5)
    assert polls[-1] <= np.nanmax(res.finished) < polls[-1] + 0.5 + 1.0
    fresh = ClusterSimulator(SC, cache(300), COST, num_replicas=2, router_policy="cache_aware")
    fresh.run(wl)
    assert fresh.poll_times == []  # fresh stats come with every decision, not on a clock
    with pytest.raises(ValueError, match="stats_period_s"):
        ClusterSimulator(SC, cache(300), COST, num_replicas=2, stats_period_s=-1)
    with pytest.raises(ValueError, match="router_policy"):
        ClusterSimulator(SC, cache(300), COST, num_replicas=2, router_policy="random")


def test_simulate_cli_compares_router_policies(tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["simulate", "--workload", "multi-turn", "--num-requests", "120",
               "--request-rate", "20", "--multi-turn-system-prompt-len", "256",
               "--num-replicas", "3", "--router-policy", "round_robin,cache_aware",
               "--router-stats-period", "0.25", "--num-gpu-blocks-override", "400",
               "--goodput", "ttft:500", "--out", str(out), "--plain", "--no-progress",
               "--no-plots"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "on 3 replicas" in text and "Per-replica load" in text
    assert "| 2 |" in text and "Prefix-cache hit rate" in text
    doc = json.loads((out / "result.json").read_text())
    assert [r["label"] for r in doc["runs"]] == ["round_robin", "cache_aware"]
    assert len(doc["runs"][1]["metrics"]["replicas"]) == 3
    assert doc["cluster"]["stats_period_s"] == 0.25
