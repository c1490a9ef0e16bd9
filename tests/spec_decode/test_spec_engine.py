"""Speculative decoding end to end on a small random-weight Llama: greedy token ids equal
transformers' ``generate`` and iterserve without speculation, in mixed batches, under
chunked prefill, preemption and prefix caching; an oracle proposer makes drafts stand
so multi-token steps, stop tokens, max_tokens and logprobs are exercised."""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

import pytest
import torch

from iterserve import LLM, SamplingParams
from iterserve.core.sampling_params import StructuredOutputsParams
from iterserve.spec_decode import Proposer
from tests.model.helpers import hf_greedy, make_checkpoint, random_prompts

# K every step: the adaptive rule follows measured step times, which a test must not
# depend on.
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "adaptive": False}
MAX_NEW = 24


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("spec_llama")
    return path, make_checkpoint(path, "llama")


def prompts_for(vocab: int, lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    """Prompts that repeat themselves, so the n-gram proposer finds matches."""
    out = []
    for i, n in enumerate(lengths):
        base = random_prompts([max(n // 3, 2)], vocab, seed=seed + i)[0]
        out.append((base * 4)[:n])
    return out


def generate(llm: LLM, prompts: list[list[int]], sp: SamplingParams):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


def greedy(max_tokens: int = MAX_NEW, **kw) -> SamplingParams:
    """Greedy with EOS banned, as ``hf_greedy`` (min_new_tokens)."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, **kw)


SCENARIOS = {
    # name: (engine args, prompt lengths)
    "mixed": ({}, [5, 17, 30, 9, 44]),
    "chunked": ({"max_num_batched_tokens": 16, "long_prefill_token_threshold": 8}, [40, 23, 7]),
    "preempt": ({"num_gpu_blocks": 7, "block_size": 8, "max_num_seqs": 4}, [18, 20, 14, 9]),
    "swap": ({"num_gpu_blocks": 7, "block_size": 8, "max_num_seqs": 4,
              "preemption_mode": "swap", "swap_space": 32}, [18, 20, 14, 9]),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_greedy_ngram_equals_transformers(ckpt, name):
    path, hf = ckpt
    args, lengths = SCENARIOS[name]
    args = {"num_gpu_blocks": 64, "backend": "torch", **args}
    prompts = prompts_for(hf.config.vocab_size, lengths)
    llm = LLM(str(path), speculative_config=NGRAM, **args)
    outs = generate(llm, prompts, greedy())
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p, MAX_NEW)
    sched = llm.engine.scheduler
    assert sched.spec.stats.num_draft_tokens > 0
    if name in ("preempt", "swap"):
        assert sched.num_preemptions > 0
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_prefix_cache_hits_with_speculation(ckpt):
    path, hf = ckpt
    shared = prompts_for(hf.config.vocab_size, [40])[0]
    prompts = [[*shared, 7, 8, 9], [*shared, 10, 11]]
    llm = LLM(str(path), speculative_config=NGRAM, num_gpu_blocks=64, block_size=8,
              backend="torch")
    first = generate(llm, prompts, greedy())
    again = generate(llm, prompts, greedy())
    for p, a, b in zip(prompts, first, again):
        ref = hf_greedy(hf, p, MAX_NEW)
        assert a.token_ids == ref and b.token_ids == ref
    assert again[0].num_cached_tokens >= 32


class OracleProposer(Proposer):
    """Proposes the true greedy continuation (known in advance), corrupting one draft
    token in three so both accepted and rejected drafts occur."""

    method = "ngram"

    def __init__(self, refs: dict[tuple[int, ...], list[int]], seed: int = 0) -> None:
        self.refs = refs
        self.rng = random.Random(seed)
        self.finished: list[str] = []

    def propose(self, req_id, token_ids, k, num_prompt_tokens=0):
        prompt = tuple(token_ids[:num_prompt_tokens])
        done = len(token_ids) - num_prompt_tokens
        truth = self.refs[prompt][done : done + k]
        return [t if self.rng.random() > 0.33 else (t + 1) % 500 for t in truth]

    def on_request_finished(self, req_id, token_ids, num_prompt_tokens):
        self.finished.append(req_id)


def oracle_llm(path, hf, prompts, *, k=4, max_new=MAX_NEW, **args) -> tuple[LLM, OracleProposer]:
    refs = {tuple(p): hf_greedy(hf, p, max_new + k + 2) for p in prompts}
    spec = {"method": "ngram", "num_speculative_tokens": k, "adaptive": False}
    llm = LLM(str(path), speculative_config=spec, num_gpu_blocks=64, **args)
    oracle = OracleProposer(refs)
    llm.engine.proposer = oracle
    return llm, oracle


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_accepted_drafts_keep_greedy_output_exact(ckpt, backend):
    path, hf = ckpt
    prompts = random_prompts([6, 19, 33], hf.config.vocab_size, seed=5)
    llm, oracle = oracle_llm(path, hf, prompts, backend=backend)
    outs = generate(llm, prompts, greedy())
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p, MAX_NEW)
    st = llm.engine.scheduler.spec.stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    assert st.accepted_per_pos[0] >= st.accepted_per_pos[-1] > 0
    assert sorted(oracle.finished) == sorted(o.request_id for o in outs)
    # Several tokens landed per step: fewer steps than tokens.
    assert llm.engine.num_steps < sum(len(o.token_ids) for o in outs)


def test_n_samples_each_speculate(ckpt):
    path, hf = ckpt
    prompts = random_prompts([9], hf.config.vocab_size, seed=2)
    llm, _ = oracle_llm(path, hf, prompts, backend="torch")
    (out,) = llm.generate([{"prompt_token_ids": prompts[0]}], greedy(n=3), use_tqdm=False)
    ref = hf_greedy(hf, prompts[0], MAX_NEW)
    assert [c.token_ids for c in out.outputs] == [ref] * 3
    assert llm.engine.scheduler.spec.stats.num_drafts >= 3


def test_stop_strings_with_several_tokens_per_step(ckpt):
    path, hf = ckpt
    prompts = random_prompts([8, 13], hf.config.vocab_size, seed=7)
    llm, _ = oracle_llm(path, hf, prompts, k=5, backend="torch")
    plain = LLM(str(path), num_gpu_blocks=64, backend="torch")
    text = generate(plain, prompts, greedy())[0].text
    sp = greedy(stop=[text[len(text) // 2 : len(text) // 2 + 3]])
    sp.min_tokens = 0
    want, got = generate(plain, prompts, sp), generate(llm, prompts, sp)
    assert [o.text for o in got] == [o.text for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    assert want[0].finish_reason == "stop"
    assert llm.engine.scheduler.spec.stats.num_accepted_tokens > 0


def test_max_tokens_and_stop_tokens_inside_drafts(ckpt):
    path, hf = ckpt
    prompts = random_prompts([8, 12], hf.config.vocab_size, seed=9)
    refs = [hf_greedy(hf, p, 40) for p in prompts]
    llm, _ = oracle_llm(path, hf, prompts, k=5, max_new=40, backend="torch")
    for max_tokens in (1, 2, 7, 13):
        outs = generate(llm, prompts, greedy(max_tokens))
        assert [o.token_ids for o in outs] == [r[:max_tokens] for r in refs]
        assert all(o.finish_reason == "length" for o in outs)
    # A stop token that greedy decoding produces at output position 9 of the first prompt.
    stop = refs[0][9]
    # EOS banned through logit_bias (as hf_greedy bans it), so the stop token ends it.
    sp = SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop],
                        logit_bias={hf.config.eos_token_id: -100.0})
    plain = LLM(str(path), num_gpu_blocks=64, backend="torch")
    want = generate(plain, prompts, sp)
    got = generate(llm, prompts, sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    assert got[0].token_ids[-1] == stop and len(got[0].token_ids) <= 10


def test_logprobs_with_accepted_drafts(ckpt):
    path, hf = ckpt
    prompts = random_prompts([10, 15], hf.config.vocab_size, seed=11)
    sp = greedy(12, logprobs=3)
    llm, _ = oracle_llm(path, hf, prompts, backend="torch")
    plain = LLM(str(path), num_gpu_blocks=64, backend="torch")
    got, want = generate(llm, prompts, sp), generate(plain, prompts, sp)
    assert llm.engine.scheduler.spec.stats.num_accepted_tokens > 0
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert len(g.logprobs) == len(w.logprobs) == 12
        for a, b in zip(g.logprobs, w.logprobs):
            assert (a.token_id, a.rank) == (b.token_id, b.rank)
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-4)


@pytest.mark.parametrize("penalties", [{"repetition_penalty": 1.3},
                                       {"presence_penalty": 0.8, "frequency_penalty": 0.6}])
def test_penalties_follow_each_drafted_position(ckpt, penalties):
    """Penalties depend on the tokens before a position: each verified row counts the
    drafts ahead of it, so output equals plain decoding's; drafts proposed from the
    penalised output itself are accepted."""
    path, hf = ckpt
    prompts = random_prompts([10, 14], hf.config.vocab_size, seed=3)
    sp = greedy(16, **penalties)
    plain = LLM(str(path), num_gpu_blocks=64, backend="torch")
    want = generate(plain, prompts, sp)
    refs = {tuple(p): [*o.token_ids, 1, 2, 3, 4, 5, 6] for p, o in zip(prompts, want)}
    llm = LLM(str(path), num_gpu_blocks=64, backend="torch",
              speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                  "adaptive": False})
    llm.engine.proposer = OracleProposer(refs)
    assert [o.token_ids for o in generate(llm, prompts, sp)] == [o.token_ids for o in want]
    st = llm.engine.scheduler.spec.stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens


def test_structured_outputs_beside_speculating_requests(ckpt):
    """A grammar request gets no drafts and stays in its language; its unconstrained
    neighbour in the same batch still speculates and stays exact."""
    path, hf = ckpt
    prompts = random_prompts([10, 12], hf.config.vocab_size, seed=4)
    llm, _ = oracle_llm(path, hf, prompts, backend="torch")
    so = SamplingParams(temperature=0.0, max_tokens=20,
                        structured_outputs=StructuredOutputsParams(regex=r"[a-c]{2,6}-\d{2}"))
    outs = llm.generate([{"prompt_token_ids": prompts[0]}, {"prompt_token_ids": prompts[1]}],
                        [so, greedy()], use_tqdm=False)
    assert re.fullmatch(r"[a-c]{2,6}-\d{2}", outs[0].text)
    assert outs[1].token_ids == hf_greedy(hf, prompts[1], MAX_NEW)
    st = llm.engine.scheduler.spec.stats
    assert st.num_accepted_tokens > 0
