"""Sampling through the engine (seeds, logprobs vs transformers) and the batched
sampler's transformations in isolation."""

from __future__ import annotations

import pytest
import torch

from iterserve import LLM, SamplingParams
from iterserve.core.request import Request
from iterserve.model.sampler import Sampler, apply_penalties, apply_top_k_top_p
from tests.model.helpers import hf_logits, random_prompts


@pytest.fixture(scope="module")
def llm(llama_ckpt):
    path, _ = llama_ckpt
    return LLM(str(path), dtype="float32", num_gpu_blocks=256, block_size=8)


def test_seeded_sampling_same_alone_or_in_batch(llm, llama_ckpt):
    _, hf = llama_ckpt
    prompts = random_prompts([9, 30, 4, 17], hf.config.vocab_size, seed=5)
    sp = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=12)
    alone = llm.generate([prompts[0]], sp, use_tqdm=False)[0].token_ids
    again = llm.generate([prompts[0]], sp, use_tqdm=False)[0].token_ids
    others = [
        SamplingParams(temperature=1.0, max_tokens=12),  # unseeded neighbours
        SamplingParams(temperature=0.7, seed=99, max_tokens=12),
        SamplingParams(temperature=0.0, max_tokens=12),
    ]
    batch = llm.generate(prompts, [sp, *others], use_tqdm=False)
    assert alone == again == batch[0].token_ids
    # A different seed gives a different sample (overwhelmingly likely at this length).
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=4321, max_tokens=12)
    assert llm.generate([prompts[0]], other_seed, use_tqdm=False)[0].token_ids != alone


def test_n_samples_are_distinct_and_reproducible(llm, llama_ckpt):
    _, hf = llama_ckpt
    prompt = random_prompts([8], hf.config.vocab_size, seed=6)[0]
    sp = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8)
    a = llm.generate([prompt], sp, use_tqdm=False)[0]
    b = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) == 3


def test_logprobs_match_hf_log_softmax(llm, llama_ckpt):
    _, hf = llama_ckpt
    prompts = random_prompts([6, 21], hf.config.vocab_size, seed=8)
    sp = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6, logprobs=5)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    for p, o in zip(prompts, outs):
        seq = p + o.token_ids
        ref = torch.log_softmax(hf_logits(hf, seq), dim=-1)
        assert len(o.logprobs) == len(o.token_ids)
        for k, lp in enumerate(o.logprobs):
            row = ref[len(p) - 1 + k]
            assert lp.token_id == o.token_ids[k]
            assert abs(lp.logprob - row[lp.token_id].item()) < 1e-4
            assert lp.rank == 1  # greedy picks the top token
            top_v, top_i = row.topk(5)
            assert [t for t, _ in lp.top] == top_i.tolist()
            assert torch.allclose(torch.tensor([v for _, v in lp.top]), top_v, atol=1e-4)


def test_bad_sampling_params_name_the_field():
    for kwargs, field in [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)


def test_generate_rejects_prompt_longer_than_context(llm):
    with pytest.raises(ValueError, match="too long"):
        llm.generate([[5] * 600], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


# ----------------------------------------------------------------- unit level


def _req(rid: str, prompt: list[int], out: list[int], **kw) -> Request:
    r = Request(rid, prompt, SamplingParams(**kw), 0.0, eos_token_id=0)
    r.all_token_ids.extend(out)
    return r


def test_top_k_top_p_masks_per_row():
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    y = apply_top_k_top_p(x, top_k=[2, 4], top_p=[1.0, 0.7])
    assert torch.isfinite(y[0]).tolist() == [True, True, False, False]
    # top_p 0.7: 0.5 (before: 0) and 0.3 (before: 0.5) stay, 0.15 (before: 0.8) goes.
    assert torch.isfinite(y[1]).tolist() == [True, True, False, False]


def test_penalties():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    r = _req("a", [0], [1, 2, 2], repetition_penalty=2.0, frequency_penalty=0.5,
             presence_penalty=0.25)
    out = apply_penalties(logits, [r])
    # token 0: prompt only -> repetition only: 2 / 2 = 1
    # token 1: output once: -2 * 2 - 0.5 - 0.25 = -4.75
    # token 2: output twice: 1 / 2 - 1.0 - 0.25 = -0.75
    # token 3: unseen: 0.5
    assert torch.allclose(out, torch.tensor([[1.0, -4.75, -0.75, 0.5]]))


def test_min_tokens_suppresses_eos_and_min_p():
    s = Sampler(seed=0)
    logits = torch.tensor([[5.0, 1.0, 0.0], [5.0, 1.0, 0.0]])
    a = _req("a", [1], [], temperature=0.0, min_tokens=2, stop_token_ids=[1])
    b = _req("b", [1], [], temperature=0.0)
    tokens, _ = s.sample(logits, [a, b])
    assert tokens == [2, 0]  # a cannot pick EOS (0) or its stop token (1)
    c = _req("c", [1], [], temperature=1.0, min_p=0.5, seed=3)
    for _ in range(20):
        assert s.sample(torch.tensor([[3.0, 2.9, -5.0]]), [c])[0][0] in (0, 1)


def test_sampler_drop_forgets_generators():
    s = Sampler(seed=0)
    r = _req("x", [1, 2], [], temperature=1.0, seed=11)
    first = s.sample(torch.zeros(1, 50), [r])[0]
    s.drop(["x"])
    assert s.sample(torch.zeros(1, 50), [r])[0] == first


def test_generate_is_all_or_nothing_when_a_prompt_is_rejected(llm):
    with pytest.raises(ValueError, match="too long"):
        llm.generate([[5] * 10, [5] * 600], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
