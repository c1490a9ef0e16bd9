"""The simulator: same code path as the engine, baselines, Little's law, the stability check."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from iterserve.config import CacheConfig, SchedulerConfig
from iterserve.core.baselines import DynamicBatchScheduler, StaticBatchScheduler
from iterserve.core.request import Request
from iterserve.core.sampling_params import SamplingParams
from iterserve.engine.core import EngineCore
from iterserve.sim import report
from iterserve.sim.cost_model import CostModel
from iterserve.sim.executor import SIM_EOS_TOKEN_ID, SimulatedExecutor, VirtualClock
from iterserve.sim.simulator import Simulator, compute_metrics, simulate, stability_check
from iterserve.sim.workload import make_workload, prompt_token_ids

# A 7B-on-H100-like model, fixed so the tests do not depend on presets.
COST = CostModel(t0=5e-3, prefill_token=2e-5, decode_seq=3e-5, context_token=2e-7, swap_block=2e-4)


def configs(scheduler="continuous", *, blocks=4096, seqs=64, budget=512, batch=16, **kw):
    sc = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=8192,
                         scheduler=scheduler, static_batch_size=batch,
                         dynamic_batch_window_s=0.05, **kw)
    return sc, CacheConfig(block_size=16, num_gpu_blocks=blocks)


def test_simulator_and_hand_stepped_engine_emit_the_same_scheduler_outputs():
    wl = make_workload(120, rate=30.0, prompt_len="uniform:8:300", output_len="lognormal:40:1.0:400",
                       seed=2)
    sc, cc = configs(blocks=80, seqs=16, budget=128)  # small KV: preemptions happen too
    sim = Simulator(sc, cc, COST)
    res = sim.run(wl, trace_outputs=True)
    assert res.num_preemptions_total > 0

    # The same engine, driven step by step by hand.
    clock = VirtualClock(0.0)
    ex = SimulatedExecutor(COST, clock)
    engine = EngineCore(sc, cc, ex, clock=clock.now)
    pending = list(enumerate(wl.requests))
    trace, finished = [], {}
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1].arrival_time <= clock.t:
            i, spec = pending.pop(0)
            req = Request(str(i), prompt_token_ids(spec, i), SamplingParams(max_tokens=None),
                          spec.arrival_time, eos_token_id=SIM_EOS_TOKEN_ID)
            ex.set_output_len(req.request_id, spec.prompt_len, spec.output_len)
            engine.add_request(req)
        if not engine.has_unfinished_requests():
            clock.t = pending[0][1].arrival_time
            continue
        for o in engine.step():
            if o.finish_reason:
                finished[o.request_id] = o.finish_reason
        trace.append(engine.last_scheduler_output.summary())
    assert trace == sim.scheduler_outputs
    # The model ended each request exactly at its hidden length, by EOS.
    assert set(finished.values()) == {"stop"}
    assert res.output_len.tolist() == [s.output_len for s in wl.requests]


def _ratio(cont, other, key):
    return cont.metrics[key] / other.metrics[key]


def test_continuous_beats_static_and_dynamic_and_the_gap_closes_with_equal_lengths():
    def run(scheduler, output_len):
        wl = make_workload(300, rate=40.0, prompt_len="uniform:64:256", output_len=output_len, seed=5)
        sc, cc = configs(scheduler, seqs=16, budget=2048, batch=16)
        return simulate(wl, sc, cc, COST)

    heavy = "lognormal:100:1.2:2000"
    equal = "fixed:100"
    runs = {(s, o): run(s, o) for s in ("continuous", "static", "dynamic") for o in (heavy, equal)}
    gaps = {}
    for o in (heavy, equal):
        c = runs["continuous", o]
        for s in ("static", "dynamic"):
            b = runs[s, o]
            if o == heavy:
                assert c.metrics["output_token_throughput"] > 1.2 * b.metrics["output_token_throughput"]
                assert c.metrics["ttft_ms"]["mean"] < b.metrics["ttft_ms"]["mean"]
            gaps[s, o] = _ratio(c, b, "output_token_throughput")
    for s in ("static", "dynamic"):
        assert gaps[s, equal] < gaps[s, heavy]
        assert gaps[s, equal] < 1.25  # equal lengths: no tail idling, only lockstep prefill


def test_littles_law_holds_in_steady_state():
    wl = make_workload(3000, rate=1.0, prompt_len="uniform:32:256", output_len="lognormal:64:0.8:512",
                       seed=11)
    sc, cc = configs(seqs=64, budget=512)
    cap = stability_check(wl, COST, sc, cc).capacity_requests_per_s
    wl = make_workload(3000, rate=0.7 * cap, prompt_len="uniform:32:256",
                       output_len="lognormal:64:0.8:512", seed=11)
    res = simulate(wl, sc, cc, COST)
    ll = res.metrics["littles_law"]
    assert ll["rel_error"] < 0.05, ll
    assert not res.stability.is_oversubscribed
    assert res.metrics["num_completed"] == 3000


def test_stability_check_flags_oversubscription():
    sc, cc = configs(seqs=32, budget=512)
    base = make_workload(200, rate=1.0, prompt_len="fixed:200", output_len="fixed:100", seed=0)
    cap = stability_check(base, COST, sc, cc).capacity_requests_per_s
    over = make_workload(200, rate=2.0 * cap, prompt_len="fixed:200", output_len="fixed:100", seed=0)
    under = make_workload(200, rate=0.5 * cap, prompt_len="fixed:200", output_len="fixed:100", seed=0)
    c_over, c_under = stability_check(over, COST, sc, cc), stability_check(under, COST, sc, cc)
    assert c_over.is_oversubscribed and "WARNING: oversubscribed" in c_over.message()
    assert not c_under.is_oversubscribed and "WARNING" not in c_under.message()
    assert 1.5 < c_over.utilization < 2.5  # the sampled rate of 200 Poisson arrivals
    # The capacity is real: at 2x the queue grows, at 0.5x it does not.
    r_over, r_under = simulate(over, sc, cc, COST), simulate(under, sc, cc, COST)
    assert r_over.metrics["max_waiting"] > 5 * max(r_under.metrics["max_waiting"], 1)
    offline = stability_check(make_workload(10, arrival="all-at-once"), COST, sc, cc)
    assert offline.is_offline and not offline.is_oversubscribed


def test_static_batches_admit_together_and_wait_for_the_whole_batch():
    sc, cc = configs("static", batch=4, seqs=64, budget=4096)
    clock = VirtualClock()
    ex = SimulatedExecutor(COST, clock)
    engine = EngineCore(sc, cc, ex, clock=clock.now)
    assert isinstance(engine.scheduler, StaticBatchScheduler)
    lens = [2, 2, 2, 30, 5, 5]
    for i, n in enumerate(lens):
        r = Request(str(i), [10 + i] * 20, SamplingParams(max_tokens=None), 0.0,
                    eos_token_id=SIM_EOS_TOKEN_ID)
        ex.set_output_len(r.request_id, 20, n)
        engine.add_request(r)
    running_sets = []
    while engine.has_unfinished_requests():
        engine.step()
        so = engine.last_scheduler_output
        running_sets.append({r.request_id for r in so.scheduled_requests})
        engine.scheduler.check_invariants()
    # Requests 4 and 5 wait until the first batch (with its 30-token straggler) drains.
    first_with_4 = next(k for k, s in enumerate(running_sets) if "4" in s)
    assert first_with_4 >= 30
    assert all(s <= {"0", "1", "2", "3"} for s in running_sets[:first_with_4])
    # Padding is charged: the straggler's lone decode steps cost 4 slots.
    assert engine.scheduler.num_batches == 2


def test_dynamic_waits_for_a_full_batch_or_the_window():
    sc, cc = configs("dynamic", batch=4)
    wl = make_workload(3, arrival="all-at-once", prompt_len="fixed:32", output_len="fixed:4")
    sim = Simulator(sc, cc, COST)
    res = sim.run(wl)
    assert isinstance(sim.engine.scheduler, DynamicBatchScheduler)
    # Three requests never fill a batch of 4: the first is scheduled when the 50 ms window ends.
    assert np.allclose(res.first_scheduled, 0.05)
    full = sim.run(make_workload(4, arrival="all-at-once", prompt_len="fixed:32", output_len="fixed:4"))
    assert np.allclose(full.first_scheduled, 0.0)


def test_baselines_keep_invariants_under_preemption():
    for scheduler in ("static", "dynamic"):
        sc, cc = configs(scheduler, blocks=40, seqs=8, budget=256, batch=8)
        wl = make_workload(60, rate=50.0, prompt_len="uniform:16:120", output_len="uniform:1:200", seed=1)
        sim = Simulator(sc, cc, COST)
        res = sim.run(wl)
        assert res.metrics == {} and len(res.finished) == 60
        assert not np.isnan(res.finished).any()
        assert res.num_preemptions_total > 0
        assert sim.engine.scheduler.kv.num_free_blocks == 40


def test_metrics_report_and_json(tmp_path):
    wl = make_workload(100, rate=20.0, prompt_len="uniform:16:200", output_len="lognormal:50:1:400")
    sc, cc = configs()
    res = simulate(wl, sc, cc, COST, goodput={"ttft": 100, "tpot": 20})
    m = res.metrics
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "queue_ms"):
        assert set(m[key]) == {"mean", "median", "p90", "p99"}
        assert m[key]["median"] <= m[key]["p90"] <= m[key]["p99"]
    assert 0 <= m["goodput"]["requests_per_s"] <= m["request_throughput"]
    assert m["mean_batch_size"] > 1 and 0 < m["max_kv_usage"] <= 1
    # ITLs are the gaps between a request's tokens: they sum to E2E - TTFT.
    done = ~np.isnan(res.finished)
    assert res.itl.sum() == pytest.approx(((res.finished - res.first_token)[done]).sum())
    text = report.format_table([("continuous", m), ("again", compute_metrics(res))])
    assert "TTFT p99 (ms)" in text and "again" in text
    path = report.save_json(tmp_path / "r.json", [res], {"workload": wl.describe()}, with_records=True)
    doc = json.loads(path.read_text())  # strict JSON: no NaN
    assert doc["runs"][0]["metrics"]["num_completed"] == 100
    assert len(doc["runs"][0]["records"]) == 100
    assert not math.isnan(doc["runs"][0]["stability"]["utilization"])


def test_slo_policy_learns_the_step_time_from_the_steps_the_engine_reports():
    # No prior: the step-time model starts from a generic guess and fits the cost model
    # (linear, so exactly learnable) from the durations update() is handed.
    wl = make_workload(300, rate=40.0, prompt_len="uniform:16:600", output_len="uniform:8:200",
                       seed=4)
    sc, cc = configs(blocks=2048, seqs=32, budget=512, scheduling_policy="slo")
    sim = Simulator(sc, cc, COST)
    sim.run(wl)
    model = sim.engine.scheduler.policy.model
    assert model.num_observations == sim.engine.num_steps
    want = (COST.t0, COST.prefill_token, COST.decode_seq, COST.context_token)
    for got, w in zip(model.coefficients, want):
        assert got == pytest.approx(w, rel=0.05)
