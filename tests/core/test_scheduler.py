import pytest

from iterserve.core.request import RequestStatus

from .helpers import EOS, fake_model_output, make_request, make_scheduler, run_to_completion


def test_decodes_first_then_chunked_prefill_backfills():
    s = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=16)
    for i in range(3):
        s.add_request(make_request(f"d{i}", 4, max_tokens=50))
    out = s.schedule(0.0)
    s.update(out, fake_model_output(out), 0.0)  # all three prefilled (12 tokens)
    s.add_request(make_request("long", 40, max_tokens=4))
    out = s.schedule(1.0)
    ids = [r.request_id for r in out.scheduled_requests]
    assert ids == ["d0", "d1", "d2", "long"]
    assert out.num_scheduled_tokens == [1, 1, 1, 13]  # budget 16: 3 decodes + 13-token chunk
    assert out.num_decode_tokens == 3 and out.num_prefill_tokens == 13
    assert out.total_num_scheduled_tokens == 16


def test_long_prefill_threshold_caps_one_requests_share():
    s = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=10)
    s.add_request(make_request("a", 30))
    s.add_request(make_request("b", 30))
    out = s.schedule(0.0)
    assert out.num_scheduled_tokens == [10, 10]


def test_finished_requests_free_blocks_and_backfill_next_step():
    s = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=1)
    s.add_request(make_request("a", 3, max_tokens=2))
    s.add_request(make_request("b", 3, max_tokens=2))
    out = s.schedule(0.0)
    assert [r.request_id for r in out.scheduled_requests] == ["a"]
    s.update(out, fake_model_output(out), 0.0)
    out = s.schedule(1.0)
    outs = s.update(out, fake_model_output(out), 1.0)
    assert outs[0].finish_reason == "length"
    assert s.kv.num_free_blocks == 4
    out = s.schedule(2.0)
    assert [r.request_id for r in out.scheduled_requests] == ["b"]
    assert out.finished_req_ids == ["a"]


def test_stop_conditions():
    s = make_scheduler()
    s.add_request(make_request("eos", 3, max_tokens=10, ignore_eos=False))
    s.add_request(make_request("min", 3, max_tokens=10, ignore_eos=False, min_tokens=3))
    s.add_request(make_request("stopid", 3, max_tokens=10, stop_token_ids=[5]))
    outs, _ = [], None
    reasons = {}
    now = 0.0
    tokens = {"eos": [EOS], "min": [EOS, EOS, EOS], "stopid": [9, 5]}
    pos = {k: 0 for k in tokens}
    while s.has_unfinished_requests():
        out = s.schedule(now)
        sampled = {}
        for r in out.scheduled_requests:
            seq = tokens[r.request_id]
            sampled[r.request_id] = seq[min(pos[r.request_id], len(seq) - 1)]
            pos[r.request_id] += 1
        from iterserve.core.outputs import ModelRunnerOutput

        outs = s.update(out, ModelRunnerOutput(sampled), now)
        for o in outs:
            if o.finish_reason:
                reasons[o.request_id] = (o.finish_reason, o.stop_reason)
        now += 1
    assert reasons == {"eos": ("stop", None), "min": ("stop", None), "stopid": ("stop", 5)}


def test_rejects_requests_that_can_never_fit():
    s = make_scheduler(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="prompt is too long"):
        s.add_request(make_request("a", 64))
    with pytest.raises(ValueError, match="KV cache"):
        s.add_request(make_request("b", 20))  # 16 slots in the whole cache
    with pytest.raises(ValueError, match="max_tokens"):
        s.add_request(make_request("c", 10, max_tokens=60))
    with pytest.raises(ValueError, match="max_tokens"):
        s.add_request(make_request("d", 10, max_tokens=10))  # 19 slots > 16
    s.add_request(make_request("e", 10, max_tokens=7))
    with pytest.raises(ValueError, match="request_id"):
        s.add_request(make_request("e", 3))
    assert not s.requests.keys() - {"e"}


def test_default_max_tokens_fills_the_context():
    s = make_scheduler(num_blocks=64, block_size=4, max_model_len=32)
    r = make_request("a", 10, max_tokens=8)
    r.sampling_params.max_tokens = None
    s.add_request(r)
    assert r.max_tokens == 22


def test_abort_waiting_running_unknown_and_twice():
    s = make_scheduler(max_num_seqs=1)
    s.add_request(make_request("a", 5))
    s.add_request(make_request("b", 5))
    out = s.schedule(0.0)
    s.update(out, fake_model_output(out), 0.0)
    outs = s.abort_requests(["a", "b", "zzz"])
    assert {o.request_id: o.finish_reason for o in outs} == {"a": "abort", "b": "abort"}
    assert s.abort_requests(["a"]) == []
    assert not s.has_unfinished_requests()
    s.check_invariants()


def test_abort_between_schedule_and_update_is_safe():
    s = make_scheduler()
    s.add_request(make_request("a", 5))
    out = s.schedule(0.0)
    s.abort_requests("a")
    assert s.update(out, fake_model_output(out), 0.0) == []
    s.check_invariants()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_memory_pressure_finishes_everything(mode):
    s = make_scheduler(
        num_blocks=10, block_size=4, max_num_seqs=4, preemption_mode=mode, swap_space=16
    )
    for i in range(4):
        s.add_request(make_request(f"r{i}", 6, max_tokens=12))
    outs, steps = run_to_completion(s)
    finished = [o.request_id for o in outs if o.finish_reason]
    assert sorted(finished) == [f"r{i}" for i in range(4)]
    assert s.num_preemptions > 0
    if mode == "swap":
        assert any(st.blocks_to_swap_out for st in steps)
        assert any(st.blocks_to_swap_in for st in steps)
    for o in outs:
        assert o.finish_reason in (None, "length")


def test_recompute_victim_is_newest_and_returns_to_front():
    s = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=3, max_num_batched_tokens=64)
    for i in range(3):
        s.add_request(make_request(f"r{i}", 8, max_tokens=17, arrival=float(i)))
    out = s.schedule(0.0)  # each takes 2 blocks: cache full
    s.update(out, fake_model_output(out), 0.0)
    out = s.schedule(1.0)  # r0 needs a third block at token 9
    assert out.preempted_req_ids == ["r2"]
    assert s.policy.peek().request_id == "r2"
    assert s.requests["r2"].status == RequestStatus.PREEMPTED
    assert s.requests["r2"].num_computed_tokens == 0
    # No admission in a step that had to preempt.
    assert "r2" not in [r.request_id for r in out.scheduled_requests]


def test_swap_falls_back_to_recompute_when_host_pool_full():
    s = make_scheduler(
        num_blocks=6, block_size=4, max_num_seqs=3, preemption_mode="swap", swap_space=1
    )
    for i in range(3):
        s.add_request(make_request(f"r{i}", 8, max_tokens=17, arrival=float(i)))
    out = s.schedule(0.0)
    s.update(out, fake_model_output(out), 0.0)
    out = s.schedule(1.0)
    assert out.preempted_req_ids == ["r2"]
    assert out.blocks_to_swap_out == []
    assert s.requests["r2"].num_computed_tokens == 0


def test_prefix_cache_counters_and_reuse():
    s = make_scheduler(num_blocks=64, block_size=4)
    prefix = list(range(1, 17))
    s.add_request(make_request("a", [*prefix, 100], max_tokens=2))
    run_to_completion(s)
    s.add_request(make_request("b", [*prefix, 200], max_tokens=2))
    out = s.schedule(10.0)
    assert out.num_computed_tokens == [16]
    assert out.num_scheduled_tokens == [1]
    assert s.stats.prefix_cache_hits == 16
    assert s.stats.prefix_cache_queries == 34
    assert s.requests["b"].num_cached_tokens == 16


def test_failed_step_requests_end_with_error_and_free_blocks():
    from iterserve.core.outputs import ModelRunnerOutput

    s = make_scheduler()
    a = make_request("a", 9)
    s.add_request(a)
    s.add_request(make_request("b", 9))
    out = s.schedule(0.0)
    outs = s.update(out, ModelRunnerOutput({"b": 3}, failed_req_ids=["a"]), 0.0)
    assert {o.request_id: o.finish_reason for o in outs} == {"b": None, "a": "error"}
    # Nothing of the failed request's (never computed) KV may enter the prefix cache.
    assert a.block_hashes and not any(h in s.kv.pool.cached for h in a.block_hashes)
    assert s.kv.num_free_blocks + len(s.requests["b"].block_ids) == s.kv.num_blocks
    run_to_completion(s)
    s.check_invariants()
