"""logit_bias, allowed_token_ids and bad_words through the real engine (offline; the
HTTP side is tests/server/test_sampling_fields.py)."""

from __future__ import annotations

import pytest
import torch

from iterserve import LLM, SamplingParams
from iterserve.model.default_model import RANDOM_MODEL_NAME

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    torch.set_num_threads(1)
    mp = pytest.MonkeyPatch()
    mp.setenv("ITERSERVE_CACHE", str(tmp_path_factory.mktemp("cache")))
    try:
        yield LLM(RANDOM_MODEL_NAME, num_gpu_blocks=128, max_num_seqs=8)
    finally:
        mp.undo()


def greedy(llm, n=16, **kw):
    p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)
    return llm.generate([PROMPT], p, use_tqdm=False)[0].token_ids


def test_allowed_token_ids_and_logit_bias(llm):
    base = greedy(llm)
    allowed = [5, 77, 123, 300]
    assert set(greedy(llm, allowed_token_ids=allowed)) <= set(allowed)
    assert greedy(llm, logit_bias={77: 100.0}) == [77] * 16
    banned = greedy(llm, logit_bias={base[0]: -100.0})
    assert banned[0] != base[0]
    # Plain neighbours in the same batch are untouched.
    outs = llm.generate([PROMPT, PROMPT], [
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logit_bias={77: 100.0}),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)], use_tqdm=False)
    assert outs[1].token_ids == base


def test_bad_words(llm):
    base = greedy(llm, n=24)
    seq = base[4:6]
    out = greedy(llm, n=24, bad_words=["x"], bad_words_token_ids=[seq])
    first = next(j for j in range(1, len(base)) if base[j - 1:j + 1] == seq)
    assert out[:first] == base[:first] and out[first] != base[first]
    assert all(out[i:i + 2] != seq for i in range(len(out) - 1))
    word = llm.tokenizer.decode([base[0]])
    ids = llm.tokenizer.encode(word.strip(), add_special_tokens=False)
    if len(ids) == 1:
        out = greedy(llm, bad_words=[word])
        assert ids[0] not in out


def test_token_ids_outside_the_vocabulary_are_value_errors(llm):
    vocab = llm.model_config.vocab_size
    for kw, name in [({"logit_bias": {vocab: 1.0}}, "logit_bias"),
                     ({"allowed_token_ids": [1, vocab + 5]}, "allowed_token_ids"),
                     ({"stop_token_ids": [vocab]}, "stop_token_ids")]:
        with pytest.raises(ValueError, match=name):
            llm.generate([PROMPT], SamplingParams(**kw), use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101.0})
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    assert not llm.engine.has_unfinished_requests()
