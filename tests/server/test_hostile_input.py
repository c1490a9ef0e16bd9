"""Hostile request bodies: lone UTF-16 surrogates anywhere, lax numbers and booleans,
a client leaving mid-body. Each a 400 naming the field (or, for the client that left,
one debug line and a counter), never a 500 or a logged traceback."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import time

import httpx
import pytest

from tests.server.helpers import MODEL
from tests.server.test_errors import assert_error, assert_serving

SURROGATE = "a\\ud800b"  # as JSON text: the escape decodes to a lone surrogate
CHAT = {"model": MODEL, "max_tokens": 2}
# (endpoint, JSON body text with a lone surrogate, the param the 400 must name)
SURROGATE_CASES = [
    ("/v1/completions", f'{{"model": "{MODEL}", "prompt": "{SURROGATE}", "max_tokens": 2}}',
     "prompt"),
    ("/v1/completions", f'{{"model": "{MODEL}", "prompt": ["ok", "{SURROGATE}"]}}', "prompt.1"),
    ("/v1/completions", f'{{"model": "{MODEL}", "prompt": "{SURROGATE}", "stream": true}}',
     "prompt"),
    ("/v1/completions", f'{{"model": "{SURROGATE}", "prompt": "hi"}}', "model"),
    ("/v1/completions", f'{{"prompt": "hi", "stop": ["{SURROGATE}"]}}', "stop.0"),
    ("/v1/completions", f'{{"prompt": "hi", "x_unknown": "{SURROGATE}"}}', "x_unknown"),
    ("/v1/chat/completions",
     f'{{"messages": [{{"role": "user", "content": "{SURROGATE}"}}], "max_tokens": 2}}',
     "messages.0.content"),
    ("/v1/chat/completions",
     f'{{"messages": [{{"role": "user", "content": "{SURROGATE}"}}], "stream": true}}',
     "messages.0.content"),
    ("/v1/chat/completions",
     f'{{"messages": [{{"role": "user", "content": [{{"type": "text", "text": "{SURROGATE}"}}]}}]}}',
     "messages.0.content.0.text"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "{SURROGATE}", "content": "x"}}]}}',
     "messages.0.role"),
    ("/tokenize", f'{{"prompt": "{SURROGATE}"}}', "prompt"),
    ("/tokenize", f'{{"messages": [{{"role": "user", "content": "{SURROGATE}"}}]}}',
     "messages.0.content"),
    ("/detokenize", f'{{"tokens": [1], "model": "{SURROGATE}"}}', "model"),
]


@contextlib.contextmanager
def captured_logs():
    """Every record the server's loggers emit meanwhile (uvicorn's do not propagate)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep(level=logging.DEBUG)
    loggers = [logging.getLogger(n) for n in ("", "uvicorn")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
    logging.getLogger("iterserve.server").setLevel(logging.DEBUG)
    try:
        yield records
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.removeHandler(handler)
            lg.setLevel(level)
        logging.getLogger("iterserve.server").setLevel(logging.NOTSET)


def tracebacks(records: list[logging.LogRecord]) -> list[str]:
    return [r.getMessage() for r in records if r.exc_info or r.levelno >= logging.ERROR]


@pytest.mark.parametrize(("path", "body", "param"), SURROGATE_CASES,
                         ids=[f"{c[0]}:{c[2]}" for c in SURROGATE_CASES])
def test_lone_surrogate_is_a_400_naming_the_field(server, path, body, param):
    with captured_logs() as records:
        r = httpx.post(server.base_url + path, content=body.encode(),
                       headers={"Content-Type": "application/json"}, timeout=30)
    err = assert_error(r, 400, param)
    assert err["code"] == "invalid_unicode"
    assert tracebacks(records) == []


# (body change, the param named)
LAX_VALUES = [
    ('"temperature": 1e400', "temperature"),
    ('"repetition_penalty": 1e400', "repetition_penalty"),
    ('"top_p": -1e400', "top_p"),
    ('"presence_penalty": "0.5"', "presence_penalty"),
    ('"max_tokens": "5"', "max_tokens"),
    ('"max_tokens": true', "max_tokens"),
    ('"max_tokens": 5.0', "max_tokens"),
    ('"n": true', "n"),
    ('"seed": "7"', "seed"),
    ('"echo": 1', "echo"),
    ('"stream": "true"', "stream"),
    ('"stop_token_ids": [true]', "stop_token_ids.0"),
    ('"logit_bias": {"5": 1e400}', "logit_bias.5"),
]


@pytest.mark.parametrize(("change", "param"), LAX_VALUES, ids=[c[1] for c in LAX_VALUES])
def test_strict_numbers_and_booleans(server, change, param):
    body = f'{{"model": "{MODEL}", "prompt": "hi", {change}}}'
    r = httpx.post(server.base_url + "/v1/completions", content=body.encode(),
                   headers={"Content-Type": "application/json"}, timeout=30)
    assert_error(r, 400, param)


@pytest.mark.parametrize("prompt", [[True, False], [[1, True]], [1.0, 2.0]])
def test_token_prompts_hold_integers_only(server, prompt):
    r = httpx.post(server.base_url + "/v1/completions",
                   json={"model": MODEL, "prompt": prompt}, timeout=30)
    assert_error(r, 400)
    assert r.json()["error"]["param"].startswith("prompt")


def test_chat_numbers_are_strict_too(server):
    for change, param in [({"temperature": True}, "temperature"),
                          ({"max_completion_tokens": "3"}, "max_completion_tokens"),
                          ({"top_logprobs": 1.5}, "top_logprobs")]:
        body = {"messages": [{"role": "user", "content": "hi"}], **change}
        r = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=30)
        assert_error(r, 400, param)
    assert_serving(server)


def test_client_gone_mid_body_is_a_counter_not_a_traceback(server):
    before = server.metric("client_disconnects_total", stage="body")
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n")
    with captured_logs() as records:
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
                s.sendall(head + b'{"prompt": "' + b"a" * 1000)
                time.sleep(0.05)
        deadline = time.monotonic() + 10
        while server.metric("client_disconnects_total", stage="body") < before + 3:
            assert time.monotonic() < deadline, "disconnects not counted"
            time.sleep(0.05)
    assert tracebacks(records) == []
    debug = [r for r in records if "disconnected during the request body" in r.getMessage()]
    assert len(debug) == 3 and all(r.levelno == logging.DEBUG for r in debug)
    assert_serving(server)


def test_error_bodies_are_plain_json(server):
    """A 400 for surrogate input carries no surrogate back (the response must encode)."""
    r = httpx.post(server.base_url + "/v1/completions",
                   content=b'{"prompt": "x", "user\\udc00": 1}',
                   headers={"Content-Type": "application/json"}, timeout=30)
    assert_error(r, 400)
    json.dumps(r.json(), ensure_ascii=False).encode("utf-8")


@pytest.mark.parametrize("stream", [False, True])
def test_echo_logprobs_offsets_follow_the_echoed_prompt(server, stream):
    body = {"model": MODEL, "prompt": "Hello", "echo": True, "logprobs": 1, "max_tokens": 3,
            "temperature": 0, "ignore_eos": True, "stream": stream}
    r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    if stream:
        from tests.server.test_api import sse_events

        events = [e for e in sse_events(r.text) if isinstance(e, dict) and e["choices"]]
        text = "".join(e["choices"][0]["text"] for e in events)
        offsets = [o for e in events if e["choices"][0]["logprobs"]
                   for o in e["choices"][0]["logprobs"]["text_offset"]]
        tokens = [t for e in events if e["choices"][0]["logprobs"]
                  for t in e["choices"][0]["logprobs"]["tokens"]]
    else:
        choice = r.json()["choices"][0]
        text, offsets = choice["text"], choice["logprobs"]["text_offset"]
        tokens = choice["logprobs"]["tokens"]
    n = httpx.post(server.base_url + "/tokenize", json={"prompt": "Hello"},
                   timeout=30).json()["count"]
    # The prompt's tokens from offset 0, then the generated ones after the echoed text.
    assert text.startswith("Hello") and offsets[0] == 0 and offsets[n] == len("Hello")
    assert len(offsets) == len(tokens) == n + 3 and offsets == sorted(offsets)


@pytest.fixture(scope="module")
def chunked(model_path):
    """Prompts prefilled in 32-token chunks, prefix caching on."""
    from tests.server.helpers import ServerThread

    with ServerThread(model_path, engine_args={"max_num_batched_tokens": 32}) as s:
        yield s


@pytest.mark.parametrize("stream", [False, True])
def test_echo_logprobs_include_the_prompt_as_transformers_computes(model_path, chunked,
                                                                   stream):
    """echo + logprobs: every prompt token's logprob (the first None), equal to
    transformers' within 1e-4, over chunked prefill and with the prompt already cached."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.server.test_api import sse_events

    prompt = "The quick brown fox jumps over the lazy dog. " * 6
    ids = httpx.post(chunked.base_url + "/tokenize", json={"prompt": prompt},
                     timeout=30).json()["tokens"]
    assert len(ids) > 64  # several chunks
    hf = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    expected = [ref[k - 1, ids[k]].item() for k in range(1, len(ids))]
    body = {"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 2,
            "temperature": 0, "ignore_eos": True, "stream": stream}
    for _ in range(2):  # the second time the prompt's blocks are in the prefix cache
        r = httpx.post(chunked.base_url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        if stream:
            events = [e["choices"][0] for e in sse_events(r.text)
                      if isinstance(e, dict) and e["choices"]]
            lp = events[0]["logprobs"]
            assert events[0]["text"] == prompt
        else:
            choice = r.json()["choices"][0]
            lp = choice["logprobs"]
            assert choice["text"].startswith(prompt)
        n = len(ids)
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        got = lp["token_logprobs"][1:n]
        assert len(got) == n - 1
        assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) < 1e-4
        assert lp["text_offset"][:n] == sorted(lp["text_offset"][:n])
        assert lp["text_offset"][0] == 0
        assert all(len(t) <= 3 for t in lp["top_logprobs"][1:n])  # top 2 (+ the token)
        if not stream:
            assert len(lp["tokens"]) == n + 2 and lp["text_offset"][n] == len(prompt)
