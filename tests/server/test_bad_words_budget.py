"""bad_words cost bounded work: capped in count and bytes (a 400 naming the field),
tokenized in linear time off the event loop, matched each step by one lookup per
prefix length whatever the number of words; vLLM's meaning kept."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from iterserve.core.sampling_params import bad_words_token_ids_for
from iterserve.model.logits_processors import BadWords
from tests.server.helpers import MODEL
from tests.server.test_errors import assert_error, assert_serving

# Floods are bounded: a regression to quadratic or on-loop work fails here, not in CI's limit.
pytestmark = pytest.mark.timeout(300)


def post(server, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/completions",
                      json={"model": MODEL, "prompt": "Hello", "max_tokens": 2, **body},
                      timeout=timeout)


def test_too_many_bad_words_is_a_400(server):
    cap = server.config.max_bad_words
    err = assert_error(post(server, {"bad_words": [f"w{i}" for i in range(cap + 1)]}), 400,
                       "bad_words")
    assert str(cap) in err["message"] and "--max-bad-words" in err["message"]
    # A body holding ~900k words (what 8 MiB allows) is refused as quickly.
    err = assert_error(post(server, {"bad_words": ["ab"] * 900_000}), 400, "bad_words")
    assert "--max-bad-words" in err["message"]
    assert_serving(server)


def test_bad_words_over_the_caps_are_refused_before_validation(server):
    """The caps are checked on the parsed JSON: the words are never validated (a body
    whose other fields are also invalid gets the bad_words 400)."""
    cap = server.config.max_bad_words
    for words in ([f"w{i}" for i in range(cap + 1)],
                  ["x" * (server.config.max_bad_words_bytes // 2 + 1)] * 2):
        err = assert_error(post(server, {"bad_words": words, "max_tokens": "5"}), 400,
                           "bad_words")
        assert "--max-bad-words" in err["message"]
    # Within the caps, validation still speaks first.
    assert_error(post(server, {"bad_words": ["ok"], "max_tokens": "5"}), 400, "max_tokens")


def test_bad_words_over_the_byte_cap_is_a_400(server):
    cap = server.config.max_bad_words_bytes
    words = ["x" * (cap // 4 + 1)] * 4
    err = assert_error(post(server, {"bad_words": words}), 400, "bad_words")
    assert "--max-bad-words-bytes" in err["message"]


def test_bad_words_at_the_cap_are_served_and_tokenized_off_the_loop(server):
    """The cap's worth of words is accepted; their tokenization runs on the engine
    client's bad-words pool (the prompt's on its tokenizer pool), never on the event
    loop's thread: the words in one batch of the tokenizer's backend (without the GIL)."""
    tok = server.engine.tokenizer
    threads: set[str] = set()
    backend = tok._tokenizer

    class Recording:
        def __getattr__(self, name):
            return getattr(backend, name)

        def encode_batch(self, *args, **kwargs):
            threads.add(threading.current_thread().name)
            return backend.encode_batch(*args, **kwargs)

    tok._tokenizer = Recording()
    try:
        words = [f"zq{i}" for i in range(server.config.max_bad_words)]
        r = post(server, {"bad_words": words, "max_tokens": 4, "temperature": 0})
    finally:
        tok._tokenizer = backend
    assert r.status_code == 200, r.text
    assert threads and all(t.startswith(("iterserve-tok", "iterserve-bad-words"))
                           for t in threads), threads
    assert any(t.startswith("iterserve-bad-words") for t in threads), threads


def test_a_bad_words_flood_leaves_other_clients_served(server):
    """Concurrent requests at the caps: every one answered, and a plain request and the
    health check beside them too (bounded: the caps bound each request's work)."""
    words = [f"flood{i}" for i in range(server.config.max_bad_words)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        flood = [pool.submit(post, server, {"bad_words": words}) for _ in range(6)]
        t0 = time.monotonic()
        assert httpx.get(server.base_url + "/health", timeout=30).status_code == 200
        # The loop is never held: before the caps 20k words froze it for 20 s.
        assert time.monotonic() - t0 < 5
        assert_serving(server)
        assert [f.result().status_code for f in flood] == [200] * 6


class _Id(int):
    """A token id that counts its comparisons (how dedup scales, without a clock)."""

    calls = 0

    def __eq__(self, other):
        _Id.calls += 1
        return int.__eq__(self, other)

    __hash__ = int.__hash__


class _Tokenizer:
    def encode(self, text, add_special_tokens=False):
        return [_Id(ord(c)) for c in text]


@pytest.mark.parametrize("n", [1000, 4000])
def test_tokenizing_bad_words_takes_linear_comparisons(n):
    """The sequences are deduplicated through a set: comparisons grow with the words,
    not their square (the old list scan made ~n^2: 4000 words froze the server)."""
    words = [f"w{i:05d}" for i in range(n)] + ["w00001"]  # one duplicate
    _Id.calls = 0
    seqs = bad_words_token_ids_for(_Tokenizer(), words)
    assert len(seqs) == 2 * n  # each alone and after a space; the duplicate dropped
    assert _Id.calls <= 20 * n, _Id.calls


seqs_st = st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=4), max_size=30)


@settings(max_examples=200, deadline=None)
@given(seqs=seqs_st, out=st.lists(st.integers(0, 6), max_size=8))
def test_the_index_bans_what_the_rule_bans(seqs, out):
    """vLLM's rule: the last token of a bad word is banned when the output ends with
    the word's other tokens (a one-token word always)."""
    want = {s[-1] for s in seqs if len(s) == 1 or (out[len(out) - len(s) + 1:] == s[:-1]
            and len(out) >= len(s) - 1)}
    assert set(BadWords(seqs).banned(out)) == want


def test_a_step_looks_up_once_per_prefix_length():
    index = BadWords([[i, i + 1, i + 2] for i in range(5000)] + [[i] for i in range(100)])
    assert list(index.by_prefix) == [2] and len(index.always) == 100
    assert set(index.banned([7, 0, 1])) == set(range(100)) | {2}
