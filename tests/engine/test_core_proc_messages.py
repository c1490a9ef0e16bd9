"""The engine core process's messages (engine/core_proc_messages.py): requests, step
outputs and per-request facts survive msgspec's encoding unchanged, field by field."""

from __future__ import annotations

import dataclasses

import msgspec

from iterserve.core.outputs import EngineCoreOutput, EngineCoreOutputs, TokenLogprobs
from iterserve.core.request import Request
from iterserve.core.sampling_params import SamplingParams, StructuredOutputsParams
from iterserve.engine import core_proc_messages as m

ENC = msgspec.msgpack.Encoder()


def _roundtrip(msg, typ=m.ToEngine):
    return msgspec.msgpack.Decoder(typ).decode(ENC.encode(msg))


def _every_field_set() -> SamplingParams:
    so = StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=True,
                                 reasoning_end_token_ids=(5, 6))
    so.compiled = object()  # an engine-local object: it must stay behind
    return SamplingParams(
        n=1, max_tokens=9, min_tokens=2, temperature=0.7, top_p=0.9, top_k=5, min_p=0.05,
        seed=3, stop=["a", "bc"], stop_token_ids=[4], include_stop_str_in_output=True,
        ignore_eos=True, logprobs=2, prompt_logprobs=1, repetition_penalty=1.1,
        presence_penalty=0.2, frequency_penalty=0.3, skip_special_tokens=False,
        ttft_slo_ms=100.0, tpot_slo_ms=20.0, structured_outputs=so,
        logit_bias={7: -3.5, 11: 2.0}, allowed_token_ids=[1, 2, 7, 11],
        bad_words=["x"], bad_words_token_ids=[[9, 10]], stream_interval=3)


def test_a_request_crosses_with_every_sampling_field():
    params = _every_field_set()
    req = Request("r-1", [1, 2, 3], params, 12.5, eos_token_id=2, priority=-1,
                  tenant="t", cache_salt="salt")
    msg = _roundtrip(m.EngineInputs(adds=[m.request_to_wire(req)], aborts=["r-0"]))
    assert isinstance(msg, m.EngineInputs) and msg.aborts == ["r-0"] and msg.finishes == []
    got = m.request_from_wire(msg.adds[0])
    for name in ("request_id", "prompt_token_ids", "arrival_time", "eos_token_id", "priority",
                 "tenant", "cache_salt", "stop_token_set", "max_tokens"):
        assert getattr(got, name) == getattr(req, name), name
    a, b = got.sampling_params, params
    for f in dataclasses.fields(b):
        if f.name != "structured_outputs":
            assert getattr(a, f.name) == getattr(b, f.name), f.name
    assert a.structured_outputs == b.structured_outputs  # (compiled is never compared)
    assert a.structured_outputs.compiled is None
    assert a.structured_outputs.reasoning_end_token_ids == (5, 6)
    assert list(a.logit_bias) == [7, 11]  # int keys, as the sampler indexes them


def test_step_outputs_rebuild_the_engines_outputs():
    lp = TokenLogprobs(8, -0.5, 1, [(8, -0.5), (3, -1.25)])
    outputs = EngineCoreOutputs({"a": 8, "b": 4, "c": 5})
    outputs.req_ids = ["a", "b", "c"]
    outputs.logprobs = {"a": lp}
    outputs.add_final(EngineCoreOutput("b", [4], None, "length"))
    outputs.add_final(EngineCoreOutput("d", [], None, "error", "RuntimeError: boom"))
    outputs.multi["c"] = EngineCoreOutput("c", [6, 7, 5])  # accepted drafts, then a token
    req_ids, token_ids, lps, finished, multi = m.outputs_to_wire(outputs)
    stats = m.WireStats(2, 1, 0.25, 48, 64, 3, 100, 40, 17, 0, 5, 12, 7, [4, 3])
    msg = m.StepOutputs(req_ids, token_ids, lps, finished, [], stats, [("e", True, "slo")], 9.0,
                        multi)
    got = _roundtrip(msg, m.FromEngine)
    assert isinstance(got, m.StepOutputs)
    rebuilt = m.outputs_from_wire(got)
    assert rebuilt == outputs.as_list()
    assert rebuilt[2].new_token_ids == [6, 7, 5]
    assert rebuilt.token_ids == [8, 4, 5] and rebuilt.logprobs == {"a": lp}
    assert got.rejected == [("e", True, "slo")]
    snap = m.snapshot_of(got.stats)
    assert (snap.num_running, snap.num_waiting, snap.kv_cache_usage, snap.num_free_blocks,
            snap.num_blocks, snap.num_preemptions, snap.prefix_cache_queries,
            snap.prefix_cache_hits) == (2, 1, 0.25, 48, 64, 3, 100, 40)
    assert (snap.spec_num_drafts, snap.spec_num_draft_tokens, snap.spec_num_accepted_tokens,
            snap.spec_accepted_per_pos) == (5, 12, 7, (4, 3))


def test_request_updates_carry_what_the_output_processor_reads():
    engine_side = Request("r", [1, 2, 3], SamplingParams(prompt_logprobs=1), 1.0)
    engine_side.first_scheduled_time = 1.5
    engine_side.num_cached_tokens = 16
    engine_side.num_preemptions = 2
    engine_side.prompt_logprobs = [TokenLogprobs(2, -1.0, 3, [(4, -0.1)]),
                                   TokenLogprobs(3, -2.0, 1, [(3, -2.0)])]
    update = _roundtrip(m.StepOutputs([], [], None, [], [m.update_of(engine_side)],
                                      m.WireStats(0, 0, 0.0, 1, 1, 0, 0, 0, 0, 0), [], 0.0),
                        m.FromEngine).updates[0]
    server_side = Request("r", [1, 2, 3], SamplingParams(prompt_logprobs=1), 1.0)
    m.apply_update(server_side, update)
    for name in ("first_scheduled_time", "num_cached_tokens", "num_preemptions",
                 "prompt_logprobs"):
        assert getattr(server_side, name) == getattr(engine_side, name), name


def test_control_messages_are_told_apart():
    for msg in (m.SetFault("hang", 3, 0.5), m.SetStepTimeout(None), m.SetStepTimeout(0.2),
                m.ConfigureGrammar({"max_lexer_states": 10}), m.Shutdown()):
        assert _roundtrip(msg) == msg
