"""The suffix proposer: drafts from the request's own text and from earlier requests'
outputs, the bounded global cache (FIFO eviction), and re-synchronisation."""

from __future__ import annotations

import pytest

from iterserve.config_speculative import parse_speculative_config
from iterserve.spec_decode import make_proposer
from iterserve.spec_decode.suffix import SuffixCache, SuffixProposer


def proposer(**kw: object) -> SuffixProposer:
    cfg = parse_speculative_config({"method": "suffix", "num_speculative_tokens": 8, **kw})
    assert cfg is not None
    p = make_proposer(cfg, max_model_len=1000)
    assert isinstance(p, SuffixProposer)
    return p


def test_proposes_what_followed_in_the_prompt() -> None:
    p = proposer(suffix_decoding_max_spec_factor=4.0)
    prompt = [50, 1, 2, 3, 4, 5, 6, 7, 60]
    # The output starts repeating the prompt's "1 2": the rest of it is proposed.
    seq = [*prompt, 1, 2]
    assert p.propose("a", seq, 5, num_prompt_tokens=len(prompt)) == [3, 4, 5, 6, 7]
    # Appended tokens are added incrementally and the draft follows them.
    seq = [*seq, 3, 4, 5]
    assert p.propose("a", seq, 3, num_prompt_tokens=len(prompt)) == [6, 7, 60]
    tree, seen = p.cache.local["a"]
    assert seen == seq and tree.num_tokens == len(seq)


def test_outputs_of_finished_requests_help_later_ones() -> None:
    p = proposer(suffix_decoding_max_spec_factor=2.0)
    out = [11, 12, 13, 14, 15, 16]
    p.propose("a", [1, 2, *out[:1]], 4, num_prompt_tokens=2)
    p.on_request_finished("a", [1, 2, *out], 2)
    assert "a" not in p.cache.local and "a" in p.cache.cached
    # A new request (unrelated prompt) that emits 11 12 gets the rest of a's output.
    assert p.propose("b", [7, 8, 11, 12], 4, num_prompt_tokens=2) == [13, 14, 15, 16]


def test_global_cache_is_bounded_and_evicts_oldest() -> None:
    p = proposer(suffix_decoding_max_cached_requests=2, suffix_decoding_max_spec_factor=2.0)
    for i, rid in enumerate(["a", "b", "c"]):
        out = [100 * (i + 1) + j for j in range(5)]
        p.propose(rid, [1, *out[:1]], 2, num_prompt_tokens=1)
        p.on_request_finished(rid, [1, *out], 1)
    assert list(p.cache.cached) == ["b", "c"]
    # A request takes a slot when it starts: d's start evicts b, the oldest left.
    assert p.propose("d", [9, 300, 301], 3, num_prompt_tokens=1) == [302, 303, 304]
    assert list(p.cache.cached) == ["c", "d"]
    assert p.propose("e", [9, 100, 101], 3, num_prompt_tokens=1) == []
    assert list(p.cache.cached) == ["d", "e"]
    assert p.propose("f", [9, 300, 301], 3, num_prompt_tokens=1) == []  # c went too
    g = p.cache.global_tree
    assert set(g.seqs) <= set(p.cache.cached.values())
    assert g.num_tokens == sum(len(s) for s in g.seqs.values())


def test_global_cache_off() -> None:
    p = proposer(suffix_decoding_max_cached_requests=0)
    p.propose("a", [1, 2, 3], 2, num_prompt_tokens=1)
    p.on_request_finished("a", [1, 2, 3, 4, 5], 1)
    assert not p.cache.cached and p.cache.global_tree.num_tokens == 0


def test_min_token_prob_stops_uncertain_continuations() -> None:
    # "1" was followed by 2, 3, 4 and 5 once each: each continuation has p = 1/5 (the
    # current "1" at the end counts too).
    seq = [1, 2, 1, 3, 1, 4, 1, 5, 1]
    assert proposer(suffix_decoding_min_token_prob=0.3).propose("a", seq, 4, 0) == []
    assert len(proposer(suffix_decoding_min_token_prob=0.1).propose("b", seq, 4, 0)) == 1


def test_resynchronises_on_a_reused_id() -> None:
    p = proposer()
    p.propose("a", [1, 2, 3, 1, 2], 2, num_prompt_tokens=3)
    p.propose("a", [7, 8, 9], 2, num_prompt_tokens=3)  # a different sequence, same id
    _, seen = p.cache.local["a"]
    assert seen == [7, 8, 9]


def test_respects_max_model_len_and_k() -> None:
    cfg = parse_speculative_config({"method": "suffix", "num_speculative_tokens": 8,
                                    "suffix_decoding_max_spec_factor": 8.0})
    assert cfg is not None
    p = make_proposer(cfg, max_model_len=12)
    seq = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4]
    assert p.propose("a", seq, 8, 0) == [5, 6]  # two positions left under max_model_len
    assert p.propose("b", seq, 1, 0) == [5]


def test_cache_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="suffix_decoding_max_tree_depth"):
        SuffixCache(0)
    with pytest.raises(ValueError, match="suffix_decoding_max_cached_requests"):
        SuffixCache(4, -1)
