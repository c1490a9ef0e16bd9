"""A request whose prompt KV arrives from outside the engine (a decode replica of a
prefill/decode split): admission allocates its blocks and counts them computed, the
first step decodes, and a recompute preemption drops the external KV."""

from __future__ import annotations

from tests.core.helpers import fake_model_output, make_request, make_scheduler


def prefilled(rid: str, prompt_len: int, max_tokens: int = 4):
    req = make_request(rid, prompt_len, max_tokens)
    req.all_token_ids.append(7)  # the prefill replica's token
    req.num_external_computed_tokens = prompt_len
    return req


def test_admitted_with_its_kv_and_decoded_without_recompute():
    s = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=8)
    req = prefilled("a", 30)  # more prompt than the step's token budget
    s.add_request(req)
    out = s.schedule(0.0)
    assert out.scheduled_requests == [req]
    assert out.num_scheduled_tokens == [1] and out.num_computed_tokens == [30]
    assert out.num_prefill_tokens == 0 and out.num_decode_tokens == 1
    assert len(req.block_ids) == 8  # 31 tokens' slots in blocks of 4
    assert s.kv.prefix_cache_hits == 0
    s.update(out, fake_model_output(out), 0.1)
    steps = 1
    while s.requests:
        out = s.schedule(0.1 * steps)
        assert out.num_prefill_tokens == 0
        s.update(out, fake_model_output(out), 0.1 * (steps + 1))
        steps += 1
    assert req.num_output_tokens == 4 and steps == 3  # 1 from the prefill replica + 3 here
    assert s.kv.num_free_blocks == 64


def test_waits_for_blocks_and_recomputes_after_preemption():
    s = make_scheduler(num_blocks=10, block_size=4, max_num_batched_tokens=64)
    a, b = prefilled("a", 20, 12), prefilled("b", 16, 12)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule(0.0)
    # a takes 6 blocks (21 token slots); b's 5 do not fit in the 4 left: it waits.
    assert out.scheduled_requests == [a] and s.num_waiting == 1
    t = 0.0
    while True:
        assert out.num_prefill_tokens == 0  # neither prompt is ever recomputed
        s.update(out, fake_model_output(out), t + 0.1)
        t += 0.1
        if not s.requests:
            break
        out = s.schedule(t)
    assert a.is_finished and b.is_finished
    assert b.first_scheduled_time >= a.finished_time  # b started once a's blocks came free
    # Recompute preemption drops the external KV.
    s2 = make_scheduler(num_blocks=12, block_size=4, max_num_batched_tokens=64)
    c, d = prefilled("c", 19, 30), prefilled("d", 19, 30)
    s2.add_request(c)
    s2.add_request(d)
    t, preempted = 0.0, None
    while s2.requests and preempted is None:
        out = s2.schedule(t)
        if out.preempted_req_ids:
            preempted = out.preempted_req_ids[0]
        s2.update(out, fake_model_output(out), t + 0.1)
        t += 0.1
    assert preempted is not None
    victim = c if preempted == "c" else d
    assert victim.num_external_computed_tokens == 0 and victim.num_computed_tokens == 0
