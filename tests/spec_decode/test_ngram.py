"""The n-gram proposer against a plain-Python statement of vLLM's prompt-lookup rule."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from iterserve.config_speculative import SpeculativeConfig
from iterserve.spec_decode import DraftRequest, make_proposer
from iterserve.spec_decode.ngram import NgramProposer, ngram_propose


def _reference(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """Longest n in [lo, hi] whose suffix n-gram occurs earlier (with at least one token
    after it); the earliest such occurrence; up to k tokens after it."""
    t = len(tokens)
    for n in range(hi, lo - 1, -1):
        if t < n + 1:
            continue
        suffix = tokens[t - n :]
        for i in range(0, t - n):
            if tokens[i : i + n] == suffix:
                return tokens[i + n : i + n + k]
    return []


def test_copies_what_followed_the_earlier_occurrence():
    toks = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    assert ngram_propose(toks, 3, 1, 3) == [4, 5, 9]
    assert ngram_propose(toks, 10, 1, 3) == [4, 5, 9, 9, 1, 2, 3]
    # The suffix [2, 3] alone is too short for min 4.
    assert ngram_propose(toks, 3, 4, 5) == []


def test_longest_match_wins_over_earlier_shorter_one():
    toks = [7, 3, 8, 5, 7, 3, 6, 5, 7, 3]
    # [5, 7, 3] occurs at 3..5 (followed by 6); [7, 3] alone first at 0 (followed by 8).
    assert ngram_propose(toks, 1, 1, 3) == [6]
    assert ngram_propose(toks, 1, 1, 2) == [8]


def test_no_match_and_short_inputs():
    assert ngram_propose([1, 2, 3, 4], 3, 1, 3) == []
    assert ngram_propose([5], 3, 1, 3) == []
    assert ngram_propose([], 3, 1, 3) == []
    assert ngram_propose([1, 1, 1], 0, 1, 3) == []


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), max_size=40),
    k=st.integers(0, 6),
    lo=st.integers(1, 4),
    extra=st.integers(0, 3),
)
def test_matches_reference(tokens, k, lo, extra):
    hi = lo + extra
    assert ngram_propose(tokens, k, lo, hi) == _reference(tokens, k, lo, hi)
    assert ngram_propose(np.array(tokens, dtype=np.int32), k, lo, hi) == _reference(
        tokens, k, lo, hi)


def test_proposer_respects_config_and_max_model_len():
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2,
                            prompt_lookup_max=3)
    p = make_proposer(cfg, max_model_len=12)
    assert isinstance(p, NgramProposer)
    toks = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    assert p.propose("a", toks, 4) == [3, 4]  # 12 - 10 tokens of room
    assert p.propose_batch([DraftRequest("a", toks, 10, 4), DraftRequest("b", [1], 1, 4)]) == [
        [3, 4], []]
    p.on_request_finished("a", toks, 10)
    p.reset()


@settings(max_examples=150, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), min_size=0, max_size=60),
       steps=st.lists(st.integers(1, 5), min_size=1, max_size=20),
       k=st.integers(1, 6), lo=st.integers(1, 3), extra=st.integers(0, 3))
def test_incremental_index_matches_the_rule_as_the_sequence_grows(tokens, steps, k, lo, extra):
    """The proposer's per-request index, fed a sequence that grows by a few tokens a
    call (as accepted drafts add them), answers as the rule over the whole sequence;
    a shorter sequence under the same id (not the one it indexed) starts afresh."""
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_min=lo,
                            prompt_lookup_max=lo + extra)
    p = make_proposer(cfg)
    cut = 0
    for step in steps:
        cut = min(len(tokens), cut + step)
        seq = tokens[:cut]
        assert p.propose("r", seq, k) == ngram_propose(seq, k, lo, lo + extra)
    short = tokens[: len(tokens) // 2]
    assert p.propose("r", short, k) == ngram_propose(short, k, lo, lo + extra)
    p.on_request_finished("r", short, 0)
    assert "r" not in p._index
