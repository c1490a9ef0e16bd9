"""Scheduling policies: order, preemption for priority, SJF, aging, weighted fair share."""

from __future__ import annotations

import random
import statistics

from iterserve.core.outputs import ModelRunnerOutput

from .helpers import fake_model_output, make_request, make_scheduler


def admitted_order(sched, now=0.0):
    order = []
    while sched.has_unfinished_requests():
        out = sched.schedule(now)
        for r, c in zip(out.scheduled_requests, out.num_computed_tokens):
            if c == 0 and r.request_id not in order:
                order.append(r.request_id)
        sched.update(out, fake_model_output(out), now)
        now += 1
    return order


def test_priority_order_with_fcfs_ties():
    s = make_scheduler(max_num_seqs=1, scheduling_policy="priority")
    s.add_request(make_request("low", 4, max_tokens=1, priority=5, arrival=0.0))
    s.add_request(make_request("hi-late", 4, max_tokens=1, priority=0, arrival=2.0))
    s.add_request(make_request("hi-early", 4, max_tokens=1, priority=0, arrival=1.0))
    s.add_request(make_request("mid", 4, max_tokens=1, priority=2, arrival=0.5))
    assert admitted_order(s) == ["hi-early", "hi-late", "mid", "low"]


def test_fcfs_is_arrival_order():
    s = make_scheduler(max_num_seqs=1)
    for i in range(4):
        s.add_request(make_request(f"r{i}", 4, max_tokens=1, priority=3 - i, arrival=float(i)))
    assert admitted_order(s) == ["r0", "r1", "r2", "r3"]


def test_high_priority_preempts_low_when_memory_is_full():
    s = make_scheduler(num_blocks=8, block_size=4, max_num_seqs=4, scheduling_policy="priority")
    for i in range(2):
        s.add_request(make_request(f"low{i}", 15, max_tokens=17, priority=9, arrival=float(i)))
    out = s.schedule(0.0)
    s.update(out, fake_model_output(out), 0.0)
    assert s.kv.num_free_blocks == 0
    s.add_request(make_request("urgent", 6, max_tokens=4, priority=0, arrival=5.0))
    out = s.schedule(1.0)
    assert out.preempted_req_ids == ["low1"]  # worst priority, newest
    assert "urgent" in [r.request_id for r in out.scheduled_requests]
    assert "low1" not in [r.request_id for r in out.scheduled_requests]
    s.update(out, fake_model_output(out), 1.0)
    s.check_invariants()


def test_fcfs_never_preempts_to_admit():
    s = make_scheduler(num_blocks=8, block_size=4, max_num_seqs=4)
    for i in range(2):
        s.add_request(make_request(f"old{i}", 15, max_tokens=17, arrival=float(i)))
    out = s.schedule(0.0)
    s.update(out, fake_model_output(out), 0.0)
    s.add_request(make_request("new", 6, max_tokens=4, priority=-100, arrival=5.0))
    out = s.schedule(1.0)
    assert out.preempted_req_ids == []
    assert "new" not in [r.request_id for r in out.scheduled_requests]


def _mean_wait(policy: str, seed: int = 0) -> float:
    """Mean queueing delay of a mixed short/long workload that all arrives at once."""
    rng = random.Random(seed)
    s = make_scheduler(num_blocks=512, block_size=4, max_num_seqs=2, scheduling_policy=policy)
    for i in range(24):
        long = rng.random() < 0.3
        s.add_request(make_request(f"r{i}", 8, max_tokens=60 if long else 4, arrival=i * 1e-3))
    waits = {}
    now = 1.0
    while s.has_unfinished_requests():
        out = s.schedule(now)
        for r in out.scheduled_requests:
            waits.setdefault(r.request_id, now - r.arrival_time)
        s.update(out, fake_model_output(out), now)
        now += 1.0
    return statistics.mean(waits.values())


def test_sjf_lowers_mean_waiting_versus_fcfs():
    fcfs, sjf = _mean_wait("fcfs"), _mean_wait("sjf")
    assert sjf < 0.7 * fcfs, (sjf, fcfs)


def _worst_low_priority_wait(policy: str, aging_rate: float) -> float:
    """A steady stream of priority-0 requests saturates one slot; how long does a
    priority-10 request that arrived first wait?"""
    s = make_scheduler(
        num_blocks=256,
        block_size=4,
        max_num_seqs=1,
        scheduling_policy=policy,
        aging_rate=aging_rate,
    )
    s.add_request(make_request("low", 4, max_tokens=2, priority=10, arrival=0.0))
    now, i = 0.0, 0
    started = None
    while now < 400:
        if int(now) % 2 == 0:  # a new high-priority request every 2 s (each takes 2 steps)
            s.add_request(make_request(f"hi{i}", 4, max_tokens=2, priority=0, arrival=now))
            i += 1
        out = s.schedule(now)
        if started is None and any(r.request_id == "low" for r in out.scheduled_requests):
            started = now
        s.update(out, fake_model_output(out), now)
        now += 1.0
    return float("inf") if started is None else started


def test_aging_bounds_the_wait_of_a_low_priority_request():
    assert _worst_low_priority_wait("priority", 0.0) == float("inf")  # starves
    waited = _worst_low_priority_wait("aging", aging_rate=1.0)
    # Priority gap 10 at 1 unit/s: admitted soon after ~10 s of waiting.
    assert waited <= 15.0, waited


def test_weighted_fair_share_converges_to_weights():
    s = make_scheduler(
        num_blocks=1024,
        block_size=4,
        max_num_seqs=8,
        scheduling_policy="fair",
        tenant_weights={"a": 1.0, "b": 3.0},
    )
    rng = random.Random(0)
    n = 0
    shares = []
    now = 0.0
    for step in range(600):
        # Both tenants always have work queued (contention).
        for tenant in ("a", "b"):
            while sum(1 for r in s.policy if r.tenant == tenant) < 6:
                s.add_request(
                    make_request(f"{tenant}{n}", 4, max_tokens=rng.randint(2, 12), tenant=tenant, arrival=now)
                )
                n += 1
        out = s.schedule(now)
        s.update(out, fake_model_output(out), now)
        if step >= 100:
            a = sum(1 for r in s.running if r.tenant == "a")
            shares.append(a / max(1, len(s.running)))
        now += 1
    share_a = statistics.mean(shares)
    assert abs(share_a - 0.25) <= 0.025, share_a  # within 10% of 1:3


def test_chunked_prefill_keeps_steps_in_budget_and_decodes_running():
    s = make_scheduler(num_blocks=512, block_size=4, max_num_seqs=8, max_num_batched_tokens=32)
    for i in range(4):
        s.add_request(make_request(f"d{i}", 4, max_tokens=100))
    out = s.schedule(0.0)
    s.update(out, fake_model_output(out), 0.0)
    s.add_request(make_request("huge", 200, max_tokens=2))
    now = 1.0
    steps_with_huge = 0
    while "huge" in s.requests and s.requests["huge"].num_output_tokens == 0:
        out = s.schedule(now)
        assert out.total_num_scheduled_tokens <= 32
        ids = [r.request_id for r in out.scheduled_requests]
        assert all(f"d{i}" in ids for i in range(4)), "a decode was starved by the prefill"
        if "huge" in ids:
            steps_with_huge += 1
        s.update(out, ModelRunnerOutput(fake_model_output(out).sampled_token_ids), now)
        now += 1
    assert steps_with_huge >= 200 // 28
