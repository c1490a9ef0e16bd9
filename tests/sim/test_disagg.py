"""The prefill/decode simulator: KV transfers priced from bytes and the link, queued
per link; every request prefilled once, decoded once, finished once; the decode
replica starts from the transferred KV and never recomputes the prompt."""

from __future__ import annotations

import numpy as np
import pytest

from iterserve.cluster import LeastKVPolicy, ReplicaStats, ReplicaView, RequestView
from iterserve.config import CacheConfig, SchedulerConfig
from iterserve.sim.cost_model import CostModel
from iterserve.sim.disagg import DisaggSimulator, KVLink, PhaseConfig, pd_metrics
from iterserve.sim.workload import make_workload

COST = CostModel(t0=5e-3, prefill_token=2e-5, decode_seq=3e-5, context_token=2e-7)
SC = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512, max_model_len=8192)
KV_PER_TOKEN = 100_000.0


def sim(num_p=1, num_d=1, blocks=2000, gbps=100.0, latency=1e-3, **kw) -> DisaggSimulator:
    cc = CacheConfig(block_size=16, num_gpu_blocks=blocks)
    return DisaggSimulator(PhaseConfig(SC, cc, COST, num_p, "cache_aware"),
                           PhaseConfig(SC, cc, COST, num_d, "least_kv"),
                           kv_bytes_per_token=KV_PER_TOKEN, link=KVLink(gbps, latency), **kw)


def workload(n=200, rate=40.0, seed=1):
    return make_workload(n, rate=rate, prompt_len="uniform:8:600",
                         output_len="uniform:1:80", seed=seed)


def test_kv_link_prices_bytes_over_bandwidth_plus_latency():
    link = KVLink(100.0, 2e-3)  # 100 Gb/s = 12.5 GB/s
    assert link.transfer_time(0) == 2e-3
    assert link.transfer_time(12.5e9) == pytest.approx(1.0 + 2e-3)
    assert KVLink(400.0).transfer_time(1e9) == pytest.approx(0.02)
    with pytest.raises(ValueError, match="kv_link_gbps"):
        KVLink(0.0)
    with pytest.raises(ValueError, match="kv_link_latency"):
        KVLink(10.0, -1.0)


def test_transfers_are_priced_per_prompt_and_queue_on_one_link():
    wl = workload(150, rate=200.0)  # bursty enough that transfers overlap in time
    s = sim(gbps=10.0)  # a slow link: 0.08 s per 1000 tokens
    run = s.run(wl)
    moved = ~np.isnan(run.transfer_start)
    prompts = run.result.prompt_len[moved]
    dur = (run.transfer_end - run.transfer_start)[moved]
    assert np.allclose(dur, [s.link.transfer_time(KV_PER_TOKEN * p) for p in prompts])
    assert np.allclose(run.kv_bytes[moved], KV_PER_TOKEN * prompts)
    # One prefill replica, one link: no two transfers overlap, and some waited.
    order = np.argsort(run.transfer_start[moved])
    start, end = run.transfer_start[moved][order], run.transfer_end[moved][order]
    assert (start[1:] >= end[:-1] - 1e-12).all()
    assert (run.transfer_start[moved] > run.prefill_done[moved] + 1e-9).any()
    m = pd_metrics(run)
    assert m["phases"]["transfer"]["wait_ms"]["p99"] > 0
    # Two prefill replicas have a link each: transfers of different links overlap.
    run2 = sim(num_p=2, gbps=10.0).run(wl)
    assert pd_metrics(run2)["phases"]["transfer"]["wait_ms"]["mean"] < m["phases"]["transfer"][
        "wait_ms"]["mean"]


@pytest.mark.parametrize("num_p,num_d", [(1, 1), (2, 3), (3, 1)])
def test_every_request_is_prefilled_decoded_and_finished_once(num_p, num_d):
    wl = workload(250, rate=60.0, seed=num_p * 10 + num_d)
    run = sim(num_p, num_d, blocks=400).run(wl)  # small decode caches: preemptions too
    n = len(wl)
    out = np.array([s.output_len for s in wl.requests])
    assert len(run.result.arrival) == n and run.result.num_rejected == 0
    assert (run.num_prefilled == 1).all()
    assert (run.num_finished == 1).all()
    assert (run.num_decoded == (out > 1)).all()  # a one-token request ends at the prefill
    assert np.array_equal(run.result.output_len, out)
    assert not np.isnan(run.result.finished).any()
    single = out == 1
    assert single.any() and np.isnan(run.transfer_start[single]).all()
    assert (run.result.finished[single] == run.prefill_done[single]).all()
    # Both pools were used (routing), and the path is causal.
    assert len(set(run.routed_prefill.values())) == num_p
    assert len(set(run.routed_decode.values())) == num_d
    multi = ~single
    assert (run.prefill_done[multi] <= run.transfer_start[multi]).all()
    assert (run.transfer_end[multi] <= run.decode_start[multi]).all()
    assert (run.decode_start[multi] < run.result.finished[multi]).all()


def test_decode_replica_never_recomputes_the_prompt():
    wl = workload(200, rate=30.0, seed=4)
    s = sim(num_p=1, num_d=2, blocks=4000)
    run = s.run(wl)
    assert run.result.num_preemptions_total == 0
    assert run.decode_prefill_tokens == 0
    # The decode replicas computed one token per output token after the first, nothing
    # else; the prefill replica computed every prompt token.
    out = run.result.output_len
    decode_tokens = sum(sum(r.log.tokens) for r in s.decode_reps)
    assert decode_tokens == int((out[out > 1] - 1).sum())
    assert sum(s.prefill_reps[0].log.tokens) == int(run.result.prompt_len.sum())
    # Each decode request's first step started right after its KV landed, as a decode.
    m = pd_metrics(run)
    assert m["phases"]["decode"]["prefill_tokens_recomputed"] == 0


def test_preempted_decode_recomputes_and_still_finishes():
    # A decode cache too small for the load: recompute preemption drops the
    # transferred KV, which the decode replica then recomputes itself.
    wl = workload(120, rate=200.0, seed=5)
    run = sim(blocks=90).run(wl)
    assert run.result.num_preemptions_total > 0
    assert run.decode_prefill_tokens > 0
    assert (run.num_finished == 1).all()


def test_metrics_report_phases_and_goodput():
    run = sim(num_p=1, num_d=1).run(workload(150, rate=20.0))
    m = pd_metrics(run, {"ttft": 200.0, "tpot": 40.0})
    assert m["num_completed"] == 150
    ph = m["phases"]
    assert ph["transfer"]["num_transfers"] == int((run.num_decoded == 1).sum())
    assert ph["prefill"]["ttft_ms"] == m["ttft_ms"]
    assert 0 <= m["goodput"]["fraction"] <= min(ph["prefill"]["slo_fraction"],
                                                 ph["decode"]["slo_fraction"])
    assert m["goodput"]["requests_per_s"] > 0


def test_least_kv_routes_to_the_emptier_cache():
    pol = LeastKVPolicy()
    reps = [ReplicaView("a"), ReplicaView("b")]
    pol.update_stats("a", ReplicaStats(num_running=1, kv_cache_usage=0.5, num_gpu_blocks=100))
    pol.update_stats("b", ReplicaStats(num_running=5, kv_cache_usage=0.1, num_gpu_blocks=100))
    # "b" runs more requests but holds less KV.
    req = RequestView("r1", 800, block_size=16)  # 50 blocks
    assert pol.choose(req, reps) == "b"
    pol.on_routed(req, "b")  # b now holds >= 50 blocks (its report is stale)
    assert pol.kv_blocks("b") == 50
    # 50 blocks each now: the request count decides.
    assert pol.choose(RequestView("r2", 16, block_size=16), reps) == "a"
    pol.on_finished(req, "b")
    assert pol.kv_blocks("b") == 10
