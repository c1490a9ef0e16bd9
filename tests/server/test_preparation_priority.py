"""A request's preparation cannot take the engine's CPU or the interpreter: its threads
run niced (``--background-nice``), its tokenization lets go of the GIL (and stays on
those threads), and what the characters alone prove too long is refused untokenized,
never what tokenization would accept."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iterserve.core.sampling_params import bad_words_token_ids_for
from iterserve.engine import background
from iterserve.engine.background import background_nice, background_pool, set_background_nice
from iterserve.engine.tokenization import PromptTokenizer, PromptTooLongError, encode_one
from iterserve.entrypoints.server_config import ServerConfig
from tests.server.helpers import MODEL, ServerThread
from tests.server.test_errors import assert_error

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="per-thread nice is Linux's")


def thread_nice(native_id: int) -> int:
    """Field 19 of /proc/self/task/<tid>/stat: the thread's nice value."""
    with open(f"/proc/self/task/{native_id}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])


def pool_nices(pool: Any) -> list[int]:
    return [thread_nice(t.native_id) for t in pool._threads]


@pytest.fixture(scope="module")
def tok(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="module")
def pt(tok):
    p = PromptTokenizer(tok)
    yield p
    p.shutdown()


# -- niceness --------------------------------------------------------------------------


@linux_only
def test_the_configured_niceness_applies_to_threads_started_after_it():
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    before = background_nice()
    pool = background_pool(1, "test-nice")  # created before the setting: read at start
    try:
        set_background_nice(3)
        pool.submit(lambda: None).result(10)
        assert pool_nices(pool) == [min(19, base + 3)]
    finally:
        set_background_nice(before)
        pool.shutdown(wait=True)


@linux_only
def test_zero_keeps_normal_priority():
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    pool = background_pool(1, "test-nice", nice=0)
    try:
        pool.submit(lambda: None).result(10)
        assert pool_nices(pool) == [base]
    finally:
        pool.shutdown(wait=True)


@pytest.mark.parametrize("nice", [-1, 20])
def test_a_niceness_out_of_range_is_refused(nice):
    with pytest.raises(ValueError, match="background_nice"):
        set_background_nice(nice)
    with pytest.raises(ValueError, match="background_nice"):
        ServerConfig(background_nice=nice)


def test_an_unknown_background_policy_is_refused():
    with pytest.raises(ValueError, match="background_policy must be one of idle, nice"):
        ServerConfig(background_policy="fifo")


@linux_only
def test_the_servers_preparation_threads_run_at_the_configured_niceness(model_path):
    """bad_words and grammars are served correctly through their niced pools."""
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    before = background_nice()
    try:
        with ServerThread(model_path, background_nice=6) as s:
            words = [f"zq{i}" for i in range(200)]
            r = httpx.post(s.base_url + "/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0,
                "bad_words": words})
            assert r.status_code == 200, r.text
            choice = {"structured_outputs": {"choice": [f"item{i}" for i in range(400)]}}
            r = httpx.post(s.base_url + "/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": "Hello", "max_tokens": 16, "temperature": 0,
                **choice})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] in choice["structured_outputs"]["choice"]
            assert pool_nices(s.engine._bad_words_pool) == [min(19, base + 6)]
            pool = s.engine.engine_core.structured_outputs.pool
            assert pool_nices(pool._small) == [min(19, base + 3)]  # half, for small ones
            if hasattr(os, "SCHED_IDLE"):  # large work only on cycles the engine leaves
                tid = s.engine._bad_words_pool._threads
                assert [os.sched_getscheduler(t.native_id) for t in tid] == [os.SCHED_IDLE]
                assert [os.sched_getscheduler(t.native_id)
                        for t in pool._small._threads] == [os.SCHED_OTHER]
            assert os.environ.get("TOKENIZERS_PARALLELISM") == "false"
    finally:
        set_background_nice(before)


def test_the_default_is_documented():
    assert ServerConfig().background_nice == background.BACKGROUND_NICE == 10
    assert ServerConfig().background_policy == background.BACKGROUND_POLICY == "idle"


# -- tokenization without the GIL ------------------------------------------------------

TEXTS = ["", "hello world", "  leading and trailing  ", "héllo wörld ünïcode 日本語 🙂",
         "<|im_start|>user\nhi<|im_end|>", "a<|endoftext|>b", "\n\n\t x"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("add", [False, True])
def test_encode_one_is_encode(tok, pt, text, add):
    for backend in (pt._backend, pt._plain_backend):
        want = backend.encode(text, add_special_tokens=add)
        got = encode_one(backend, text, add_special_tokens=add)
        assert (got.ids, got.offsets) == (want.ids, want.offsets)
    # The plain copy still reads special-token text as plain text.
    if "<|" in text:
        special = set(pt.special_ids)
        assert not special & set(pt._encode_plain(text))
        assert special & set(pt._encode_raw(text))


def ticks_while(fn) -> tuple[int, float]:
    """How many 1 ms sleeps this thread completes while ``fn`` runs on another one,
    and how long ``fn`` took."""
    done = threading.Event()
    took = [0.0]

    def run():
        t = time.perf_counter()
        fn()
        took[0] = time.perf_counter() - t
        done.set()

    th = threading.Thread(target=run)
    th.start()
    n = 0
    while not done.is_set():
        time.sleep(0.001)
        n += 1
    th.join()
    return n, took[0]


def test_a_long_texts_tokenization_lets_the_interpreter_go(tok):
    """``Tokenizer.encode`` holds the GIL for the whole text: this thread would not
    run once until it ends. ``encode_one`` releases it."""
    text = "All work and no play makes a dull model. " * 8000  # ~320 KB, ~0.3 s
    backend = tok.backend_tokenizer
    n, took = ticks_while(lambda: encode_one(backend, text, add_special_tokens=False))
    # At least a tick per 20 ms of tokenizing (1 ms sleeps; generous for a busy machine).
    assert n >= max(3, int(took / 0.02)), (n, took)


def test_chunked_counting_lets_the_interpreter_go(tok):
    pt = PromptTokenizer(tok, max_chars_per_token=0)  # no bound: the count runs
    text = "All work and no play makes a dull model. " * 8000

    def count():
        with pytest.raises(PromptTooLongError):
            pt.encode_sync(text, add_special_tokens=True, limit=100)

    try:
        n, took = ticks_while(count)
    finally:
        pt.shutdown()
    assert n >= max(3, int(took / 0.02)), (n, took)


class _NoBackend:
    """The tokenizer seen without its Rust backend: transformers' encode per text."""

    def __init__(self, tok: Any) -> None:
        self.encode = tok.encode


WORDS = ["hello", " spaced", "héllo", "日本語", "🙂x", "<|im_end|>", "a<|endoftext|>b",
         "  ", "", "multi word phrase", "\n", "zq1", "zq1"]


def test_bad_words_in_one_batch_are_the_per_word_ids(tok):
    assert bad_words_token_ids_for(tok, WORDS) == bad_words_token_ids_for(_NoBackend(tok), WORDS)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.text(max_size=12), max_size=20))
def test_bad_words_batch_agrees_on_any_words(tok, words):
    words = [w for w in words if not any("\ud800" <= c <= "\udfff" for c in w)]
    assert bad_words_token_ids_for(tok, words) == bad_words_token_ids_for(_NoBackend(tok), words)


# -- the characters-per-token bound never refuses what tokenization accepts -----------

ALPHABET = st.sampled_from(["a", "b", " ", "\n", "é", "日", "🙂", "hello", "world ",
                            "<|im_start|>", "<|im_end|>", "<|endoftext|>", "  ", "\t", "ab"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(ALPHABET, max_size=200).map("".join), st.booleans())
def test_a_prompt_of_exactly_its_token_count_is_accepted(pt, text, add):
    n = len(pt.tokenizer.encode(text, add_special_tokens=add))
    pt.check_chars(len(text), n)  # the bound never claims more tokens than there are
    assert pt.encode_sync(text, add_special_tokens=add, limit=n) == list(
        pt.tokenizer.encode(text, add_special_tokens=add))
    if n > 0:
        with pytest.raises(PromptTooLongError):
            pt.encode_sync(text, add_special_tokens=add, limit=n - 1)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(ALPHABET, max_size=60).map("".join), min_size=1, max_size=4))
def test_a_chat_of_exactly_its_token_count_is_accepted(pt, contents):
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": c}
                for i, c in enumerate(contents)]
    n = len(pt.encode_chat_sync(messages, add_special_tokens=False, limit=10**9))
    assert len(pt.encode_chat_sync(messages, add_special_tokens=False, limit=n)) == n


def test_the_bound_and_the_count_refuse_alike(server):
    """A prompt the characters prove too long and one found too long by tokenizing get
    the same 400 (status, type, param, code)."""
    probe = PromptTokenizer(server.engine.tokenizer)
    cpt = probe.max_chars_per_token
    probe.shutdown()
    limit = server.engine.max_model_len
    counted = "hello " * (limit + 8)  # over the context, under the characters' bound
    errors = []
    for prompt in (counted, "x" * (8 * 2**20 - 4096)):
        r = httpx.post(server.base_url + "/v1/completions", timeout=120,
                       json={"model": MODEL, "prompt": prompt})
        errors.append(assert_error(r, 400, "prompt"))
    assert cpt is not None and len(counted) <= limit * cpt  # the count, not the bound
    assert "at least" not in errors[0]["message"]  # counted exactly
    assert "at least" in errors[1]["message"]  # refused from its characters
    assert [(e["type"], e["param"], e["code"]) for e in errors] == [
        ("invalid_request_error", "prompt", "context_length_exceeded")] * 2
