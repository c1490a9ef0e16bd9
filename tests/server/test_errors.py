"""Every error in OpenAI's shape, streaming and not, and the server serving afterwards."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server.helpers import MODEL
from tests.server.test_api import PROMPT, sse_events

OK_BODY = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3}


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param, err
    return err


def assert_serving(server) -> None:
    r = httpx.post(server.base_url + "/v1/completions", json=OK_BODY, timeout=30)
    assert r.status_code == 200, r.text


# (body changes, expected param); each a 400 for completions.
BAD_COMPLETIONS = [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"n": "abc"}, "n"),
    ({"n": 0}, "n"),
    ({"n": 1000}, "n"),
    ({"logprobs": 1000}, "logprobs"),
    ({"stop": ["x"] * 100}, "stop"),
    ({"temperature": "hot"}, "temperature"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"prompt": None}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"max_tokens": 255}, "max_tokens"),  # prompt + max_tokens > max_model_len (256)
    ({"prompt": "hello " * 400}, "prompt"),  # the prompt alone is over the context
    ({"min_tokens": 10, "max_tokens": 3}, "min_tokens"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("change", "param"), BAD_COMPLETIONS)
def test_bad_completion_params(server, change, param, stream):
    body = {**OK_BODY, "stream": stream, **change}
    if change.get("prompt", "") is None:
        del body["prompt"]
    r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=30)
    assert_error(r, 400, param)


@pytest.mark.parametrize("stream", [False, True])
def test_bad_chat_params(server, stream):
    url = server.base_url + "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    for body, param in [
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": msgs, "top_logprobs": 3}, "top_logprobs"),
        ({"messages": msgs, "temperature": -2}, "temperature"),
        ({"messages": msgs, "max_tokens": 10_000}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi " * 400}]}, "messages"),
    ]:
        r = httpx.post(url, json={**body, "stream": stream}, timeout=30)
        assert_error(r, 400, param)
    assert_serving(server)


def test_malformed_and_oversized_bodies(server):
    url = server.base_url + "/v1/completions"
    for content in [b"{not json", b"[1, 2]", b"\xff\xfe", b""]:
        r = httpx.post(url, content=content, headers={"content-type": "application/json"})
        assert_error(r, 400)
    big = json.dumps({**OK_BODY, "prompt": "x" * (9 * 2**20)}).encode()
    assert_error(httpx.post(url, content=big), 400)
    assert_serving(server)


@pytest.mark.parametrize("stream", [False, True])
def test_unknown_model_404(server, stream):
    r = httpx.post(server.base_url + "/v1/completions",
                   json={**OK_BODY, "model": "nope", "stream": stream})
    err = assert_error(r, 404, "model")
    assert err["code"] == "model_not_found"
    r = httpx.post(server.base_url + "/v1/chat/completions",
                   json={"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    assert_error(r, 404, "model")
    assert_error(httpx.get(server.base_url + "/no/such/path"), 404)
    assert_serving(server)


def test_openai_client_sees_typed_errors(server):
    c = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1000)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="missing", prompt=PROMPT)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                  temperature=-1, stream=True)
    assert_serving(server)


@pytest.mark.parametrize("stream", [False, True])
def test_failing_step_is_500_and_server_keeps_serving(server, stream):
    """A step that raises fails its requests (500 / an error event then [DONE]); the
    engine frees their blocks and serves the next request."""
    before = server.metric("request_success_total", finished_reason="error")
    httpx.post(server.base_url + "/_test/fault", json={"kind": "raise", "count": 1})
    try:
        body = {**OK_BODY, "max_tokens": 8, "stream": stream}
        r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=30)
        if stream:
            assert r.status_code == 200
            events = sse_events(r.text)
            assert events[-1] == "[DONE]"
            err = events[-2]["error"]
            assert err["code"] == "engine_step_failed" and "injected" in err["message"]
        else:
            assert assert_error(r, 500)["code"] == "engine_step_failed"
    finally:
        httpx.post(server.base_url + "/_test/fault", json={"kind": "none"})
    assert server.metric("request_success_total", finished_reason="error") == before + 1
    assert_serving(server)
    server.wait_idle()
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_hung_step_times_out(server):
    """A step past the step timeout fails its requests; the next step runs normally."""
    httpx.post(server.base_url + "/_test/fault",
               json={"kind": "hang", "seconds": 1.0, "count": 1, "step_timeout_s": 0.2})
    try:
        r = httpx.post(server.base_url + "/v1/completions", json=OK_BODY, timeout=30)
        assert "timeout" in assert_error(r, 500)["message"]
    finally:
        httpx.post(server.base_url + "/_test/fault", json={"kind": "none", "step_timeout_s": None})
    assert_serving(server)
    server.wait_idle()


def test_chat_min_tokens_over_what_the_context_leaves_is_a_400(server):
    # max_tokens omitted: resolved from the context left after the prompt, which can fall
    # below min_tokens (a fuzzer-found 500).
    r = httpx.post(server.base_url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "x" * 200}],
        "min_tokens": 250})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "min_tokens"
