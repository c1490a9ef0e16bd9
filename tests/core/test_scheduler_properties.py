"""Property-based tests: DESIGN.md's invariants hold after every step of random workloads."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iterserve.core.kv_groups import first_needed_block, make_kv_cache_groups
from iterserve.core.outputs import ModelRunnerOutput
from iterserve.core.request import RequestStatus
from iterserve.core.slo import AdmissionRefused

from .helpers import EOS, make_request, make_scheduler

PREFIXES = [[11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 23, 24], [31, 32, 33, 34, 35, 36]]

configs = st.fixed_dictionaries(
    {
        "num_blocks": st.integers(8, 40),
        "block_size": st.sampled_from([1, 2, 4, 8]),
        "max_num_seqs": st.integers(1, 8),
        "max_num_batched_tokens": st.integers(8, 64),
        "long_prefill_token_threshold": st.sampled_from([0, 3, 16]),
        "enable_prefix_caching": st.booleans(),
        "scheduling_policy": st.sampled_from(["fcfs", "priority", "sjf", "aging", "fair", "slo"]),
        "enable_backfill": st.booleans(),
        "backfill_max_passes": st.integers(0, 4),
        "enable_chunked_prefill": st.booleans(),
        "slo_admission": st.booleans(),
        "preemption_mode": st.sampled_from(["recompute", "swap"]),
        "swap_space": st.integers(0, 64),
        "max_preemptions_per_request": st.integers(0, 4),
        # A hybrid model's groups (one global, two local layers), or one global group.
        "sliding_window": st.sampled_from([None, None, 1, 3, 8]),
    }
)


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(cfg=configs, seed=st.integers(0, 2**32 - 1), num_steps=st.integers(20, 150))
def test_invariants_hold_after_every_step(cfg, seed, num_steps):
    rng = random.Random(seed)
    if not cfg["enable_chunked_prefill"]:
        cfg["max_num_batched_tokens"] = 128  # a whole prompt must fit one step
    window = cfg.pop("sliding_window")
    groups = None if window is None else make_kv_cache_groups([window, None, window])
    sched = make_scheduler(max_model_len=128, kv_cache_groups=groups, **cfg)
    capacity = sched.kv_capacity_tokens
    if groups is None:
        assert capacity == cfg["num_blocks"] * cfg["block_size"]
    bs = cfg["block_size"]
    accepted: set[str] = set()
    finished = Counter()
    next_id = 0
    now = 0.0

    def record(outputs):
        for o in outputs:
            assert o.request_id in accepted
            if o.finish_reason is not None:
                finished[o.request_id] += 1
                assert finished[o.request_id] == 1, f"{o.request_id} finished twice"

    def step():
        nonlocal now
        out = sched.schedule(now)
        # Invariant 3: the budget and the sequence cap.
        assert out.total_num_scheduled_tokens <= cfg["max_num_batched_tokens"]
        assert sum(out.num_scheduled_tokens) == out.total_num_scheduled_tokens
        assert len(sched.running) <= cfg["max_num_seqs"]
        assert len({r.request_id for r in out.scheduled_requests}) == out.num_reqs
        sampled = {}
        for req, n, c in zip(out.scheduled_requests, out.num_scheduled_tokens, out.num_computed_tokens):
            assert n >= 1
            assert req.status == RequestStatus.RUNNING
            assert c + n <= req.num_tokens
            assert c + n <= len(req.block_ids) * bs
            if groups is not None:
                # Every slot the step reads or writes is a real block in every group;
                # a sliding group's slots behind its window may be the null block.
                end = -(-(c + n) // bs)
                for g, spec in enumerate(groups):
                    first = first_needed_block(c, spec.sliding_window, bs)
                    assert 0 not in req.block_tables[g][first:end], (g, c, n, req.block_tables)
            if c + n == req.num_tokens:
                sampled[req.request_id] = EOS if rng.random() < 0.05 else rng.randint(1, 50)
        failed = []
        if out.scheduled_requests and rng.random() < 0.02:
            failed = [rng.choice(out.scheduled_requests).request_id]
        record(sched.update(out, ModelRunnerOutput(sampled, failed_req_ids=failed), now))
        sched.check_invariants()
        now += 0.01

    for _ in range(num_steps):
        action = rng.random()
        if action < 0.35:
            for _ in range(rng.randint(1, 3)):
                rid = f"r{next_id}"
                next_id += 1
                body = rng.randint(1, 30)
                prompt = [rng.randint(1, 50) for _ in range(body)]
                if rng.random() < 0.5:
                    prompt = rng.choice(PREFIXES) + prompt
                req = make_request(
                    rid,
                    prompt,
                    max_tokens=rng.randint(1, 40),
                    arrival=now,
                    priority=rng.randint(0, 3),
                    tenant=rng.choice(["a", "b", "c"]),
                    ignore_eos=rng.random() < 0.5,
                    ttft_slo_ms=rng.choice([None, 5.0, 50.0, 1000.0]),
                    tpot_slo_ms=rng.choice([None, 1.0, 20.0]),
                )
                try:
                    sched.add_request(req)
                except AdmissionRefused:
                    # Only the slo policy refuses for latency, and only when asked to.
                    assert cfg["slo_admission"] and cfg["scheduling_policy"] == "slo"
                    continue
                except ValueError:
                    # Only requests that can never fit may be refused.
                    assert len(prompt) + req.sampling_params.max_tokens - 1 > min(capacity, 127)
                    continue
                accepted.add(rid)
        elif action < 0.42 and sched.requests:
            victims = rng.sample(sorted(sched.requests), k=min(2, len(sched.requests)))
            record(sched.abort_requests(victims, now))
            sched.check_invariants()
        elif action < 0.45 and sched.running:
            # A stop string matched in the engine's detokenizer.
            rid = rng.choice(sched.running).request_id
            record(sched.finish_requests([rid], RequestStatus.FINISHED_STOPPED, now))
            sched.check_invariants()
        step()

    # Drain: everything accepted ends, exactly once (invariant 4), and the idle
    # engine holds no blocks (invariant 6).
    for _ in range(20_000):
        if not sched.has_unfinished_requests():
            break
        step()
    assert not sched.has_unfinished_requests(), "requests stuck"
    assert set(finished) == accepted
    assert all(v == 1 for v in finished.values())
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert sched.kv.host_pool.num_free_blocks == sched.kv.host_pool.num_blocks
