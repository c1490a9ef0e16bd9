"""Structured outputs through the real engine (the built-in random model): every output
is in its language, under batching with unconstrained requests in the same step."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from iterserve import LLM, SamplingParams
from iterserve.core.outputs import GrammarBitmask
from iterserve.core.request import Request
from iterserve.core.sampling_params import StructuredOutputsParams as SO
from iterserve.engine.structured_output import StructuredOutputManager, unpack_bitmask
from iterserve.model.default_model import RANDOM_MODEL_NAME
from iterserve.model.sampler import apply_grammar_bitmask

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    torch.set_num_threads(1)
    mp = pytest.MonkeyPatch()
    mp.setenv("ITERSERVE_CACHE", str(tmp_path_factory.mktemp("cache")))
    try:
        yield LLM(RANDOM_MODEL_NAME, num_gpu_blocks=256, max_num_seqs=32)
    finally:
        mp.undo()


def _json(**kw) -> SO:
    return SO(json=SCHEMA, disable_any_whitespace=True, **kw)


def test_every_output_is_in_its_language_in_one_mixed_batch(llm):
    kinds = [
        SamplingParams(temperature=0, max_tokens=96, structured_outputs=_json()),
        SamplingParams(temperature=1.0, seed=7, max_tokens=96, structured_outputs=_json()),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),  # unconstrained
        SamplingParams(temperature=0.9, seed=3, max_tokens=32,
                       structured_outputs=SO(regex=r"[a-z]{3}-\d{2,4}")),
        SamplingParams(temperature=0.9, seed=1, max_tokens=16,
                       structured_outputs=SO(choice=["red", "green", "blue"])),
        SamplingParams(temperature=0, max_tokens=64,
                       structured_outputs=SO(json_object=True, disable_any_whitespace=True)),
        SamplingParams(temperature=0.7, seed=5, max_tokens=32,
                       structured_outputs=SO(grammar='start: "yes" | "no" | NUMBER\n'
                                                     "NUMBER: /[0-9]{1,3}/")),
    ]
    prompts = [f"Prompt number {i}:" for i in range(len(kinds) * 3)]
    params = kinds * 3
    outs = llm.generate(prompts, params, use_tqdm=False)
    for o, p in zip(outs, params):
        so = p.structured_outputs
        if so is None:
            assert o.finish_reason == "length"
            continue
        if so.kind == "json_object" and o.finish_reason == "length":
            # Any object: a random model may write one long key; what it wrote so far
            # must still be the start of an object.
            assert o.text.startswith("{")
            continue
        assert o.finish_reason == "stop", (o.text, so.kind)
        if so.kind == "json":
            jsonschema.validate(json.loads(o.text), SCHEMA)
        elif so.kind == "json_object":
            assert isinstance(json.loads(o.text), dict)
        elif so.kind == "regex":
            assert re.fullmatch(r"[a-z]{3}-\d{2,4}", o.text), o.text
        elif so.kind == "choice":
            assert o.text in ("red", "green", "blue")
        else:
            assert re.fullmatch(r"yes|no|[0-9]{1,3}", o.text), o.text


def test_constrained_neighbours_do_not_change_unconstrained_greedy_tokens(llm):
    plain = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    alone = llm.generate(["Hello, my name is"], plain, use_tqdm=False)[0].token_ids
    mixed = llm.generate(
        ["{", "Hello, my name is", "x"],
        [SamplingParams(temperature=0, max_tokens=40, structured_outputs=_json()), plain,
         SamplingParams(temperature=0, max_tokens=8, structured_outputs=SO(regex="[0-9]+"))],
        use_tqdm=False,
    )
    assert mixed[1].token_ids == alone


def test_n_samples_each_follow_the_grammar(llm):
    out = llm.generate(
        ["pick"], SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=8,
                                 structured_outputs=SO(choice=["alpha", "beta"])),
        use_tqdm=False,
    )[0]
    assert len(out.outputs) == 4
    assert all(c.text in ("alpha", "beta") and c.finish_reason == "stop" for c in out.outputs)


def test_bad_constraints_raise_value_errors_naming_the_field(llm):
    with pytest.raises(ValueError, match="structured_outputs must set exactly one"):
        SO(json=SCHEMA, regex="a")
    with pytest.raises(ValueError, match="structured_outputs must set exactly one"):
        SO()
    with pytest.raises(ValueError, match=r"structured_outputs\.choice"):
        SO(choice=[])
    with pytest.raises(ValueError, match=r"structured_outputs\.json"):
        llm.generate(["x"], SamplingParams(structured_outputs=SO(json="{not json")),
                     use_tqdm=False)
    with pytest.raises(ValueError, match=r"structured_outputs\.regex"):
        llm.generate(["x"], SamplingParams(structured_outputs=SO(regex="(unclosed")),
                     use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert not llm.engine.structured_outputs.matchers


def test_compiled_grammars_are_cached(llm):
    manager = llm.engine.structured_outputs
    a = manager.compile(SO(regex="[0-9]{4}"))
    b = manager.compile(SO(regex="[0-9]{4}"))
    assert a is b
    assert manager.compile(SO(regex="[0-9]{5}")) is not a


def test_bitmask_rows_and_sampler_masking_agree(llm):
    manager: StructuredOutputManager = llm.engine.structured_outputs
    vocab = manager.vocab_size
    matcher = manager.compile(SO(choice=["red", "green"])).deep_copy()
    import llguidance.numpy as llg  # llguidance is a dependency
    mask = llg.allocate_token_bitmask(1, vocab)
    llg.fill_next_token_bitmask(matcher, mask, 0)
    allowed = unpack_bitmask(mask, vocab)[0]
    assert 0 < allowed.sum() < vocab
    ok_ids = np.flatnonzero(allowed)
    tok = llm.tokenizer
    assert all("red".startswith(s) or "green".startswith(s)
               for s in (tok.decode([int(t)]) for t in ok_ids))

    reqs = [Request(rid, [1, 2, 3], SamplingParams(), 0.0) for rid in ("a", "b")]
    logits = torch.randn(2, vocab)
    masked = apply_grammar_bitmask(logits, reqs, GrammarBitmask(["b"], mask))
    assert torch.equal(masked[0], logits[0])  # the unconstrained row is untouched
    finite = torch.isfinite(masked[1]).numpy()
    assert np.array_equal(finite, allowed)
    assert torch.equal(masked[1][torch.from_numpy(allowed)], logits[1][torch.from_numpy(allowed)])


def test_a_grammar_that_waits_for_the_end_of_the_reasoning(llm):
    # A reasoning model's output is free until its end marker, then in the language.
    # The bias makes token T come first; T cannot begin the choice's language.
    t = llm.get_tokenizer().encode("Hello", add_special_tokens=False)[0]
    choice = SO(choice=["red", "green"])
    gated = SO(choice=["red", "green"], reasoning_end_token_ids=(t,))
    outs = llm.generate(["pick", "pick"], [
        SamplingParams(temperature=0, max_tokens=8, logit_bias={t: 100.0},
                       structured_outputs=so) for so in (choice, gated)], use_tqdm=False)
    free, after = (o.outputs[0] for o in outs)
    assert free.text in ("red", "green") and t not in free.token_ids
    assert after.token_ids[0] == t and after.finish_reason == "stop"
    assert llm.get_tokenizer().decode(after.token_ids[1:]) in ("red", "green")
    assert not llm.engine.structured_outputs.reasoning  # dropped when the request ended
    with pytest.raises(ValueError, match=r"structured_outputs\.reasoning_end_token_ids"):
        SO(regex="a", reasoning_end_token_ids=())


def test_the_reasoning_gate_opens_on_its_token_sequence():
    from iterserve.engine.structured_output import _ReasoningGate

    gate = _ReasoningGate((7, 8))
    assert [gate.ends_with(t) for t in (8, 7, 7, 9, 7, 8)] == [False] * 5 + [True]
