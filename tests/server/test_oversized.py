"""Oversized prompts cost bounded work: refused before tokenizing when the characters
alone prove them too long, counted in chunks up to the limit otherwise, on a pool of
their own (normal requests do not queue behind them), with memory given back.

The RSS checks measure this process (the server runs in a thread here), with generous
bounds: what they catch is growth of the order of the input's full tokenization
(hundreds of MiB per 8 MiB prompt), not allocator noise."""

from __future__ import annotations

import concurrent.futures
import gc
import time

import httpx
import pytest

from iterserve.engine.tokenization import PromptTokenizer, PromptTooLongError
from tests.server.helpers import MODEL, ServerThread
from tests.server.test_errors import assert_error, assert_serving

# Just under the default 8 MiB body limit once wrapped in JSON.
BIG = ("hello world " * 800_000)[: 8 * 2**20 - 4096]
NORMAL = {"model": MODEL, "prompt": "Hello, world!", "max_tokens": 16, "ignore_eos": True,
          "temperature": 0}


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def post(server, path: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=timeout)


def test_char_bound_refuses_without_tokenizing(model_path):
    from transformers import AutoTokenizer

    pt = PromptTokenizer(AutoTokenizer.from_pretrained(model_path))
    try:
        assert pt.max_chars_per_token is not None
        # The bound is an upper bound: a real text never has fewer tokens than it claims.
        for text in ["hello world " * 50, "a" * 500, "The quick brown fox. " * 20]:
            n = len(pt.encode_sync(text, add_special_tokens=False, limit=10**6))
            assert n >= len(text) / pt.max_chars_per_token
        t0 = time.perf_counter()
        with pytest.raises(PromptTooLongError) as e:
            pt.check_chars(len(BIG), 256)
        assert not e.value.exact and e.value.num_tokens > 256
        assert time.perf_counter() - t0 < 1.0  # no tokenization happened
    finally:
        pt.shutdown()


def test_chunked_count_stops_at_the_limit(model_path):
    """With the character bound off, a long text is counted in chunks and refused once
    past the limit; a text that fits is tokenized exactly as the tokenizer does."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    pt = PromptTokenizer(tok, max_chars_per_token=0, chunk_chars=1024)
    try:
        assert pt.max_chars_per_token is None
        with pytest.raises(PromptTooLongError) as e:
            pt.encode_sync(BIG, add_special_tokens=True, limit=256)
        assert not e.value.exact
        fits = "The quick brown fox jumps over the lazy dog. " * 60  # > chunk_chars
        assert pt.encode_sync(fits, add_special_tokens=True, limit=10**6) == tok.encode(fits)
        # A count near the limit: chunk boundaries never refuse what fits.
        n = len(tok.encode(fits))
        assert len(pt.encode_sync(fits, add_special_tokens=True, limit=n)) == n
        with pytest.raises(PromptTooLongError):
            pt.encode_sync(fits, add_special_tokens=True, limit=n - 1)
    finally:
        pt.shutdown()


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": BIG}, "prompt"),
    ("/v1/completions", {"prompt": BIG, "stream": True}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": BIG}]}, "messages"),
    ("/tokenize", {"prompt": BIG}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": BIG}]}, "messages"),
], ids=["completions", "completions-stream", "chat", "tokenize", "tokenize-chat"])
def test_oversized_prompt_is_a_prompt_400(server, path, body, param):
    err = assert_error(post(server, path, {"model": MODEL, **body}), 400, param)
    assert err["code"] == "context_length_exceeded"


def test_tokenize_is_capped(model_path):
    with ServerThread(model_path, max_tokenize_tokens=20) as s:
        assert post(s, "/tokenize", {"prompt": "Hello, world!"}).json()["count"] <= 20
        err = assert_error(post(s, "/tokenize", {"prompt": "hello " * 200}), 400, "prompt")
        assert err["code"] == "context_length_exceeded" and "20" in err["message"]


def normal_beside_big(server, big_body: dict, path: str) -> tuple[float, list[float]]:
    """Start two oversized requests, then time a normal 16-token completion beside
    them; returns (its latency, the oversized ones' end times relative to its end)."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        t0 = time.monotonic()
        big = [pool.submit(lambda: (post(server, path, big_body), time.monotonic()))
               for _ in range(2)]
        time.sleep(0.3)  # both are being read and tokenized
        start = time.monotonic()
        r = post(server, "/v1/completions", NORMAL)
        end = time.monotonic()
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 16
        ends = [f.result()[1] - end for f in big]
        for f in big:
            assert f.result()[0].status_code in (200, 400), f.result()[0].text
    assert t0 < start
    return end - start, ends


def test_normal_request_stays_fast_beside_two_8mib_prompts(server):
    post(server, "/v1/completions", NORMAL)  # warm
    latency, _ = normal_beside_big(server, {"model": MODEL, "prompt": BIG}, "/v1/completions")
    # Unbounded, the two prompts' tokenization queued this request for many seconds.
    assert latency < 5.0, latency
    assert_serving(server)


def test_oversized_input_does_not_queue_normal_tokenization(model_path):
    """Character bound off and /tokenize allowed a long answer: the oversized texts are
    tokenized in full, on their own pool; the normal request, tokenized on the shared
    one, finishes before them."""
    with ServerThread(model_path, max_chars_per_token=0, max_tokenize_tokens=2**22) as s:
        post(s, "/v1/completions", NORMAL)
        big = {"prompt": ("hello world " * 100_000)[: 2**20]}
        latency, ends = normal_beside_big(s, big, "/tokenize")
        assert all(e > 0 for e in ends), (latency, ends)


@pytest.mark.parametrize("precheck", [True, False], ids=["char-bound", "chunked"])
def test_rss_stays_flat_under_repeated_oversized_requests(model_path, precheck):
    kwargs = {} if precheck else {"max_chars_per_token": 0}
    with ServerThread(model_path, **kwargs) as s:
        bodies = [("/tokenize", {"prompt": BIG}),
                  ("/v1/completions", {"model": MODEL, "prompt": BIG}),
                  ("/tokenize", {"messages": [{"role": "user", "content": BIG}]})]
        for path, body in bodies:  # warm-up: one-time allocations
            assert post(s, path, body).status_code == 400
        gc.collect()
        before = rss_mib()
        for _ in range(3):
            for path, body in bodies:
                assert post(s, path, body).status_code == 400
        gc.collect()
        grown = rss_mib() - before
        # One 8 MiB prompt tokenized in full held ~1 GiB; nine of them here.
        assert grown < 256, f"RSS grew {grown:.0f} MiB"
        assert_serving(s)
