"""Rejection sampling keeps the target distribution: statistical tests with fixed seeds
(so they are deterministic), thresholds far from what a correct sampler produces and
far below what a wrong one does."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from iterserve import LLM, SamplingParams
from iterserve.core.request import Request
from iterserve.model.rejection_sampler import verify
from iterserve.model.sampler import Sampler, target_probs
from tests.model.helpers import make_checkpoint

# z for a one-sided p-value of 1e-4: a correct sampler fails one run in ten thousand
# seeds; the seeds here are fixed, so the outcome is too.
Z = 3.719


def chi2_critical(df: int) -> float:
    """Wilson-Hilferty: the chi-square quantile at p = 1e-4 for ``df`` degrees."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + Z * math.sqrt(h)) ** 3


def chi2(observed: Counter, expected: dict[int, float]) -> tuple[float, int]:
    """Pearson's statistic over bins with >= 5 expected counts (the rest pooled)."""
    stat, df, pool_o, pool_e = 0.0, -1, 0.0, 0.0
    for t, e in expected.items():
        if e >= 5:
            stat += (observed.get(t, 0) - e) ** 2 / e
            df += 1
        else:
            pool_o += observed.get(t, 0)
            pool_e += e
    if pool_e >= 5:
        stat += (pool_o - pool_e) ** 2 / pool_e
        df += 1
    return stat, df


def _request(rid: str, **params) -> Request:
    sp = SamplingParams(max_tokens=100, **params)
    r = Request(rid, [1, 2, 3], sp, 0.0, eos_token_id=None)
    r.all_token_ids.append(4)
    r.num_computed_tokens = 3
    return r


@pytest.mark.parametrize("params", [{"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9},
                                    {"temperature": 1.3, "top_k": 4, "seed": 0}])
def test_each_position_keeps_the_target_distribution(params):
    torch.manual_seed(0)
    vocab, k = 6, 2
    logits = torch.randn(k + 1, vocab) * 1.5
    # Drafts the target often (not always) agrees with: each row's most likely token.
    drafts = logits[:k].argmax(-1).tolist()
    per_call, calls = 250, 40
    n = per_call * calls
    sampler = Sampler("cpu", seed=123, cpp_argmax=False)
    seeded = "seed" in params

    def batch(c: int) -> list[Request]:
        # Seeded requests each get their own seed (one seed twice is the same sample).
        return [_request(f"r{c}-{i}", **{**params, **({"seed": c * per_call + i} if seeded
                                                      else {})}) for i in range(per_call)]

    reqs = batch(0)
    first: Counter = Counter()
    second: Counter = Counter()  # given draft 0 accepted
    third: Counter = Counter()  # given drafts 0 and 1 accepted (the bonus token)
    n_acc0 = n_acc1 = 0
    for c in range(calls):
        out = verify(sampler, logits.repeat(per_call, 1), reqs, [drafts] * per_call)
        for r in reqs:
            acc = out.accepted[r.request_id]
            emitted = [*acc, out.sampled[r.request_id]]
            first[emitted[0]] += 1
            if len(acc) >= 1:
                n_acc0 += 1
                second[emitted[1]] += 1
            if len(acc) == 2:
                n_acc1 += 1
                third[emitted[2]] += 1
        sampler.drop(r.request_id for r in reqs)
        reqs = batch(c + 1)
    sp = reqs[0].sampling_params
    p = target_probs(logits, [sp] * (k + 1), [False] * (k + 1))
    p = (p / p.sum(-1, keepdim=True)).tolist()
    for counts, total, row in ((first, n, 0), (second, n_acc0, 1), (third, n_acc1, 2)):
        assert total > 500
        stat, df = chi2(counts, {t: total * p[row][t] for t in range(vocab)})
        assert stat < chi2_critical(df), (row, stat, df, counts)
    # The acceptance rate of draft 0 is p0(d0), as the rule says.
    d0 = drafts[0]
    sd = math.sqrt(p[0][d0] * (1 - p[0][d0]) / n)
    assert abs(n_acc0 / n - p[0][d0]) < 5 * sd
    # A wrong rule (always keep the draft) is far outside the threshold.
    stat, df = chi2(Counter({d0: n}), {t: n * p[0][t] for t in range(vocab)})
    assert stat > 10 * chi2_critical(df)


def test_greedy_rows_accept_while_the_draft_is_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    sampler = Sampler("cpu", cpp_argmax=False)
    r = _request("g", temperature=0.0)
    out = verify(sampler, logits, [r], [[1, 0]])
    assert out.accepted["g"] == [1, 0] and out.sampled["g"] == 2  # the bonus
    out = verify(sampler, logits, [r], [[1, 2]])
    assert out.accepted["g"] == [1] and out.sampled["g"] == 0  # the correction
    out = verify(sampler, logits[:1], [r], [[]])
    assert out.accepted["g"] == [] and out.sampled["g"] == 1


@pytest.fixture(scope="module")
def tiny_vocab_ckpt(tmp_path_factory):
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("tiny_vocab")
    # Token ids stay below 12 (the tokenizer's first ids), so prompts and outputs decode.
    return path, make_checkpoint(path, "llama", vocab_size=12, initializer_range=0.05)


def test_engine_samples_the_target_distribution_with_drafts(tiny_vocab_ckpt):
    """Random sampling through the engine with n-gram drafts on a 12-token model: the
    frequencies of the 2nd and 3rd output tokens (the first that drafts can cover) match
    the exact conditional probabilities transformers computes."""
    path, hf = tiny_vocab_ckpt
    prompt = [3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4, 5]
    n = 600
    llm = LLM(str(path), num_gpu_blocks=256, max_num_seqs=64, backend="torch",
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "prompt_lookup_min": 1, "prompt_lookup_max": 2,
                                  "adaptive": False})
    params = [SamplingParams(temperature=1.0, max_tokens=3, seed=i, ignore_eos=True)
              for i in range(n)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
    st = llm.engine.scheduler.spec.stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    seqs = [tuple(o.token_ids) for o in outs]
    assert all(len(s) == 3 for s in seqs)

    @torch.no_grad()
    def next_probs(prefixes: list[tuple[int, ...]]) -> dict[tuple[int, ...], list[float]]:
        ids = torch.tensor([prompt + list(pf) for pf in prefixes])
        return dict(zip(prefixes, torch.softmax(hf(ids).logits[:, -1].float(), -1).tolist()))

    for pos in (1, 2):
        prefixes = sorted({s[:pos] for s in seqs})
        probs = next_probs(prefixes)
        expected: dict[int, float] = dict.fromkeys(range(12), 0.0)
        for s in seqs:
            for t, q in enumerate(probs[s[:pos]]):
                expected[t] += q
        observed = Counter(s[pos] for s in seqs)
        stat, df = chi2(observed, expected)
        assert df >= 3 and stat < chi2_critical(df), (pos, stat, df, observed, expected)
