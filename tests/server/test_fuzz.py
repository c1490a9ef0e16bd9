"""Fuzzing the request parsing (hypothesis): arbitrary JSON values, near-valid bodies with
a few fields replaced by arbitrary values, and random bytes, against every POST endpoint.
No input may yield a 500 or an unhandled exception; every refusal is an OpenAI error
body; the server keeps serving.

Against a live server (as the other server tests) with tight limits, so the valid
requests hypothesis stumbles on stay small."""

from __future__ import annotations

import json
import logging
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iterserve.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from tests.server.helpers import MODEL, ServerThread
from tests.server.test_api import sse_events

ENDPOINTS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
FIELDS = sorted(set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
                | {"tokens"})
# ITERSERVE_FUZZ_EXAMPLES=5000 for a long hunt by hand (random, not derandomized).
_EXAMPLES = int(os.environ.get("ITERSERVE_FUZZ_EXAMPLES", "0"))
SETTINGS = settings(max_examples=_EXAMPLES or 200, deadline=None, derandomize=not _EXAMPLES,
                    database=None,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture])

json_scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
                | st.integers(-3, 300) | st.floats(allow_nan=False, allow_infinity=False)
                | st.text(max_size=12))
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=12,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant"]) | st.text(max_size=5)},
        optional={"content": st.text(max_size=20) | json_values, "name": json_values},
    ),
    max_size=3,
)
VALID = {
    "/v1/completions": {"model": MODEL, "prompt": "hello", "max_tokens": 2},
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 2},
    "/tokenize": {"prompt": "hello"},
    "/detokenize": {"tokens": [5, 6]},
}


@st.composite
def near_valid(draw):
    """A valid body with 1-3 fields replaced by (or added as) arbitrary values."""
    path = draw(st.sampled_from(ENDPOINTS))
    body = dict(VALID[path])
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(FIELDS) | st.text(max_size=6))
        if key == "messages" and draw(st.booleans()):
            body[key] = draw(messages)
        else:
            body[key] = draw(json_values)
    if draw(st.booleans()):
        body.pop(draw(st.sampled_from(sorted(body))), None)
    return path, body


@pytest.fixture(scope="module")
def fuzzed(model_path):
    with ServerThread(model_path, max_tokens_limit=4, max_n=2, max_prompts=2,
                      max_num_queued_tokens=2000, max_request_body_bytes=16384) as s:
        yield s


@pytest.fixture(scope="module")
def client(fuzzed):
    with httpx.Client(base_url=fuzzed.base_url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def server_errors():
    """Records from the server's loggers at ERROR or above (an unhandled exception)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep(logging.ERROR)
    loggers = [logging.getLogger(n) for n in ("iterserve", "uvicorn.error", "fastapi")]
    for lg in loggers:
        lg.addHandler(handler)
    yield records
    for lg in loggers:
        lg.removeHandler(handler)


def check(r: httpx.Response, errors: list[logging.LogRecord]) -> None:
    assert r.status_code < 500, r.text
    assert not errors, [e.getMessage() for e in errors]
    if r.status_code != 200:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        for e in events[:-1]:
            assert "error" not in e, e
    else:
        r.json()


@SETTINGS
@given(case=near_valid())
def test_fuzz_near_valid_bodies(client, server_errors, case):
    path, body = case
    check(client.post(path, content=json.dumps(body)), server_errors)


@SETTINGS
@given(path=st.sampled_from(ENDPOINTS), body=json_values)
def test_fuzz_any_json(client, server_errors, path, body):
    check(client.post(path, content=json.dumps(body)), server_errors)


@SETTINGS
@given(path=st.sampled_from(ENDPOINTS), content=st.binary(max_size=64)
       | st.text(max_size=64).map(str.encode),
       content_type=st.sampled_from(["application/json", "text/plain", ""]))
def test_fuzz_bytes(client, server_errors, path, content, content_type):
    check(client.post(path, content=content, headers={"content-type": content_type}),
          server_errors)


def test_still_serving_after_fuzz(fuzzed, client, server_errors):
    r = client.post("/v1/completions", json=VALID["/v1/completions"])
    assert r.status_code == 200
    fuzzed.wait_idle()
    assert not server_errors


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(text=st.text())
def test_sse_event_is_one_line_for_any_text(text):
    """Generated text can hold any character (a random model, a byte-level tokenizer): an
    event must stay one line for clients that split with str.splitlines (httpx's
    iter_lines), and decode back to the same text. (U+0085 / U+2028 once split it.)"""
    from httpx._decoders import LineDecoder

    from iterserve.entrypoints.server import _sse

    lines = LineDecoder().decode(_sse({"text": text}))
    assert lines[1:] == [""] and lines[0].startswith("data: ")
    assert json.loads(lines[0][6:]) == {"text": text}
