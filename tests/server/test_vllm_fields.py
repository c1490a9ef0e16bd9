"""vLLM's streaming and request extras through the official client: a chunk for every
engine output (even one whose text is not yet decidable), continuous usage stats,
prompt_logprobs, return_token_ids, return_tokens_as_token_ids, the body's request_id."""

from __future__ import annotations

import re
from typing import Any

import httpx
import openai
import pytest

from tests.server.helpers import MODEL
from tests.server.test_api import MESSAGES, PROMPT, sse_events
from tests.server.test_errors import assert_error

GREEDY = {"temperature": 0.0}
N = 8
# Text no tiny random model writes: a stop string that can never match whole.
NEVER = "\u2603\u2603#"
# vLLM's stream option (the client's typed dict does not know it).
CONTINUOUS: Any = {"include_usage": True, "continuous_usage_stats": True}


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def _greedy(client, **extra):
    return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, **GREEDY,
                                     extra_body={"ignore_eos": True, "return_token_ids": True,
                                                 **extra})


def test_a_completion_chunk_per_token_even_undecided(server, client):
    """Tokens 4.. spell the start of a stop string, so their text is held back until the
    end: they still make a chunk each, with empty text and their token id."""
    full = _greedy(client)
    ids = full.choices[0].token_ids
    assert len(ids) == N
    head = httpx.post(server.base_url + "/detokenize", json={"tokens": ids[:3]}).json()["prompt"]
    text = full.choices[0].text
    assert text.startswith(head) and len(text) > len(head)
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=N, **GREEDY, stream=True,
        stop=[text[len(head):] + NEVER],
        stream_options=CONTINUOUS,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    chunks = list(stream)
    body = [c for c in chunks if c.choices]
    assert [len(c.choices[0].token_ids) for c in body] == [1] * N  # one chunk per token
    assert [t for c in body for t in c.choices[0].token_ids] == ids
    assert body[0].choices[0].prompt_token_ids == full.choices[0].prompt_token_ids
    assert all(getattr(c.choices[0], "prompt_token_ids", None) is None for c in body[1:])
    assert sum(c.choices[0].text == "" for c in body) >= 3  # the held-back ones
    assert "".join(c.choices[0].text for c in body) == text
    assert body[-1].choices[0].finish_reason == "length"
    # continuous_usage_stats: usage on every chunk, counting the tokens so far.
    p = full.usage.prompt_tokens
    assert [(c.usage.prompt_tokens, c.usage.completion_tokens) for c in body] == [
        (p, k) for k in range(1, N + 1)]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == N


def test_a_chat_chunk_per_token_and_usage(client):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=N, **GREEDY)
    full = client.chat.completions.create(**kw, extra_body={"ignore_eos": True,
                                                            "return_token_ids": True})
    ids = full.choices[0].token_ids
    assert len(ids) == N == full.usage.completion_tokens
    assert len(full.prompt_token_ids) == full.usage.prompt_tokens
    chunks = list(client.chat.completions.create(
        **kw, stream=True,
        stream_options=CONTINUOUS,
        extra_body={"ignore_eos": True, "return_token_ids": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].prompt_token_ids == full.prompt_token_ids
    body = [c for c in chunks[1:] if c.choices]
    assert [t for c in body for t in c.choices[0].token_ids] == ids
    assert all(len(c.choices[0].token_ids) == 1 for c in body)
    assert "".join(c.choices[0].delta.content or "" for c in body) == \
        full.choices[0].message.content
    assert all(c.usage is not None for c in chunks)
    assert [c.usage.completion_tokens for c in body] == list(range(1, N + 1))
    # Without continuous_usage_stats, only the last chunk carries usage.
    plain = list(client.chat.completions.create(**kw, stream=True,
                                                stream_options={"include_usage": True}))
    assert [c.usage is not None for c in plain] == [False] * (len(plain) - 1) + [True]


def test_prompt_logprobs(server, client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1,
                                  extra_body={"prompt_logprobs": 2, "return_token_ids": True})
    prompt = r.choices[0].prompt_token_ids
    plp = r.choices[0].prompt_logprobs
    assert len(plp) == len(prompt) and plp[0] is None
    for tok, entry in zip(prompt[1:], plp[1:], strict=True):
        assert str(tok) in entry and 1 <= len(entry) <= 3
        ranks = sorted(e["rank"] for t, e in entry.items() if t != str(tok))
        assert ranks == list(range(1, len(ranks) + 1))
        assert all(e["logprob"] <= 0 for e in entry.values())
    # The same numbers as echo's logprobs show (one engine path, two shapes).
    echo = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, echo=True,
                                     logprobs=2)
    lps = echo.choices[0].logprobs.token_logprobs[1:len(prompt)]
    assert lps == pytest.approx([e[str(t)]["logprob"] for t, e in zip(prompt[1:], plp[1:],
                                                                       strict=True)])
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    assert chat.prompt_logprobs[0] is None
    assert len(chat.prompt_logprobs) == chat.usage.prompt_tokens
    assert all(len(e) == 1 for e in chat.prompt_logprobs[1:])  # the prompt's token only
    url = server.base_url + "/v1/completions"
    for bad in [{"prompt_logprobs": 1, "stream": True}, {"prompt_logprobs": -2},
                {"prompt_logprobs": 10**6}]:
        r = httpx.post(url, json={"prompt": PROMPT, "max_tokens": 1, **bad})
        assert assert_error(r, 400)["param"] == "prompt_logprobs", bad


def test_return_tokens_as_token_ids(client):
    r = _greedy(client, return_tokens_as_token_ids=True)
    r2 = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, **GREEDY,
                                   logprobs=2, extra_body={"ignore_eos": True,
                                                           "return_tokens_as_token_ids": True})
    lp = r2.choices[0].logprobs
    assert lp.tokens == [f"token_id:{t}" for t in r.choices[0].token_ids]
    assert all(re.fullmatch(r"token_id:\d+", k) for top in lp.top_logprobs for k in top)
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, logprobs=True, top_logprobs=2,
        extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True})
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [f"token_id:{t}" for t in chat.choices[0].token_ids]
    assert all(t.token.startswith("token_id:") for c in content for t in c.top_logprobs)


def test_body_request_id(server, client):
    r = client.completions.with_raw_response.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={"request_id": "job-7.a"})
    assert r.headers["x-request-id"] == "job-7.a" and r.parse().id == "cmpl-job-7.a"
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1,
                                          extra_body={"request_id": "job-8"})
    assert chat.id == "chatcmpl-job-8"
    # The header wins, as in vLLM; the same id twice at once is fine (engine ids differ).
    r = httpx.post(server.base_url + "/v1/completions", headers={"X-Request-Id": "hdr"},
                   json={"prompt": PROMPT, "max_tokens": 1, "request_id": "body"})
    assert r.json()["id"] == "cmpl-hdr"
    for bad in ["", "a b", "x" * 129, "é"]:
        r = httpx.post(server.base_url + "/v1/completions",
                       json={"prompt": PROMPT, "max_tokens": 1, "request_id": bad})
        assert assert_error(r, 400)["param"] == "request_id", bad


def test_streamed_ids_and_echo(server):
    """With echo, the echo chunk is the choice's first: it brings prompt_token_ids."""
    r = httpx.post(server.base_url + "/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 2, "echo": True, "stream": True,
        "return_token_ids": True, **GREEDY})
    events = [e for e in sse_events(r.text) if e != "[DONE]"]
    assert events[0]["choices"][0]["text"] == PROMPT
    assert events[0]["choices"][0]["token_ids"] == []
    assert len(events[0]["choices"][0]["prompt_token_ids"]) > 1
    assert sum(len(e["choices"][0]["token_ids"]) for e in events) == 2
