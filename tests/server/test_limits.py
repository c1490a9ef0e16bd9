"""Request limits against abuse, each a 400 naming the field (at the limit: served), the
default bind address, and the API key on every route but /health.

test_errors covers the default limits once each; here every limit is set small, checked
on both sides of the line and on both endpoints, and set from the CLI flags."""

from __future__ import annotations

import json

import httpx
import pytest

from iterserve.entrypoints.cli import build_parser
from tests.server.helpers import MODEL, ServerThread
from tests.server.test_errors import assert_error

LIMITS = dict(max_request_body_bytes=4096, max_n=2, max_logprobs=3, max_stop=2,
              max_tokens_limit=8, max_prompts=2)
MAX_MODEL_LEN = 64
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def limited(model_path):
    # /tokenize answers up to 1024 tokens here (the context length by default): the
    # tests cut over-long token prompts from it.
    with ServerThread(model_path, engine_args={"max_model_len": MAX_MODEL_LEN},
                      max_tokenize_tokens=1024, **LIMITS) as s:
        yield s


def prompt_of(server, num_tokens: int) -> list[int]:
    ids = httpx.post(server.base_url + "/tokenize", json={"prompt": "the quick brown fox " * 40},
                     ).json()["tokens"]
    return ids[:num_tokens]


# (field, a body change at the limit, one just over it)
COMPLETION_LIMITS = [
    ("n", {"n": 2, "temperature": 1.0}, {"n": 3}),
    ("logprobs", {"logprobs": 3}, {"logprobs": 4}),
    ("stop", {"stop": ["a", "b"]}, {"stop": ["a", "b", "c"]}),
    ("max_tokens", {"max_tokens": 8}, {"max_tokens": 9}),
    ("prompt", {"prompt": ["a", "b"]}, {"prompt": ["a", "b", "c"]}),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("param", "at", "over"), COMPLETION_LIMITS,
                         ids=[c[0] for c in COMPLETION_LIMITS])
def test_completion_limits(limited, param, at, over, stream):
    url = limited.base_url + "/v1/completions"
    base = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "stream": stream}
    r = httpx.post(url, json={**base, **at}, timeout=30)
    assert r.status_code == 200, r.text
    err = assert_error(httpx.post(url, json={**base, **over}, timeout=30), 400, param)
    assert param in err["message"]


@pytest.mark.parametrize(("param", "at", "over"), [
    ("n", {"n": 2, "temperature": 1.0}, {"n": 3}),
    ("top_logprobs", {"logprobs": True, "top_logprobs": 3},
     {"logprobs": True, "top_logprobs": 4}),
    ("stop", {"stop": ["a", "b"]}, {"stop": ["a", "b", "c"]}),
    ("max_tokens", {"max_tokens": 8}, {"max_tokens": 9}),
    ("max_tokens", {"max_completion_tokens": 8}, {"max_completion_tokens": 9}),
], ids=["n", "top_logprobs", "stop", "max_tokens", "max_completion_tokens"])
def test_chat_limits(limited, param, at, over):
    url = limited.base_url + "/v1/chat/completions"
    base = {"model": MODEL, "messages": MSGS, "max_tokens": 2}
    assert httpx.post(url, json={**base, **at}, timeout=30).status_code == 200
    assert_error(httpx.post(url, json={**base, **over}, timeout=30), 400, param)


def test_chat_without_max_tokens_stops_at_the_limit(limited):
    r = httpx.post(limited.base_url + "/v1/chat/completions", timeout=30,
                   json={"model": MODEL, "messages": MSGS, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8


def test_prompt_length_limit(limited):
    """The longest prompt is the context length less the completion."""
    url = limited.base_url + "/v1/completions"
    ok = prompt_of(limited, MAX_MODEL_LEN - 4)
    r = httpx.post(url, json={"prompt": ok, "max_tokens": 4}, timeout=30)
    assert r.status_code == 200, r.text
    err = assert_error(httpx.post(url, json={"prompt": [*ok, ok[0]], "max_tokens": 4}), 400,
                       "max_tokens")
    assert err["code"] == "context_length_exceeded"
    err = assert_error(httpx.post(url, json={"prompt": prompt_of(limited, MAX_MODEL_LEN)}), 400,
                       "prompt")
    assert err["code"] == "context_length_exceeded"
    r = httpx.post(limited.base_url + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "fox " * 200}]})
    assert_error(r, 400, "messages")
    # Left out, max_tokens defaults to OpenAI's 16, cut to the limit rather than refused.
    r = httpx.post(url, json={"prompt": "hi", "ignore_eos": True}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize",
                                  "/detokenize"])
def test_body_size_limit(limited, path):
    url = limited.base_url + path
    big = json.dumps({"prompt": "x" * 5000, "messages": MSGS, "tokens": [1]}).encode()
    err = assert_error(httpx.post(url, content=big), 400)
    assert err["code"] == "request_too_large" and "4096" in err["message"]

    # Chunked, with no Content-Length to trust: cut off while reading.
    def gen():
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}'

    err = assert_error(httpx.post(url, content=gen()), 400)
    assert err["code"] == "request_too_large"
    r = httpx.post(limited.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert r.status_code == 200


def test_cli_flags_set_the_limits_and_bind_localhost(model_path, monkeypatch):
    """``iterserve serve`` binds 127.0.0.1 unless told otherwise; the limit flags reach
    the server's config."""
    import uvicorn

    from iterserve.entrypoints import cli_serve

    calls: list[dict] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: calls.append({"app": app, **kw}))
    base = ["serve", "--model", str(model_path), "--device", "cpu",
            "--num-gpu-blocks-override", "8", "--max-model-len", "64"]
    assert cli_serve.run(build_parser().parse_args(base)) == 0
    assert calls[-1]["host"] == "127.0.0.1"
    cfg = calls[-1]["app"].state.serving.config
    assert cfg.max_tokens_limit is None and cfg.max_stop == 16 and not cfg.enable_test_hooks
    assert cfg.max_tokenize_tokens is None and cfg.max_chars_per_token is None
    args = build_parser().parse_args([
        *base,
        "--host", "0.0.0.0", "--max-tokens-limit", "32", "--max-stop-strings", "4",
        "--max-n", "3", "--max-logprobs", "5", "--max-request-body-bytes", "1MiB",
        "--max-tokenize-tokens", "100", "--max-chars-per-token", "0"])
    assert cli_serve.run(args) == 0
    cfg = calls[-1]["app"].state.serving.config
    assert calls[-1]["host"] == "0.0.0.0"
    assert (cfg.max_tokens_limit, cfg.max_stop, cfg.max_n, cfg.max_logprobs,
            cfg.max_request_body_bytes) == (32, 4, 3, 5, 2**20)
    assert (cfg.max_tokenize_tokens, cfg.max_chars_per_token) == (100, 0)
    assert calls[-1]["app"].state.serving.tokenization.max_chars_per_token is None


def test_api_key_guards_every_route_but_probes(model_path):
    """Every route needs the key but /health, /metrics and /version (open in vLLM too)."""
    with ServerThread(model_path, api_key="k3y", enable_test_hooks=True) as s:
        paths = {(m, r.path) for r in s.app.routes for m in getattr(r, "methods", ())
                 if m != "HEAD"}
        assert ("GET", "/openapi.json") in paths and ("POST", "/_test/fault") in paths
        for method, path in sorted(paths):
            for headers in [{}, {"Authorization": "Bearer k3y2"}, {"Authorization": "k3y"},
                            {"Authorization": "Bearer"}]:
                r = httpx.request(method, s.base_url + path, headers=headers, json={})
                if path in ("/health", "/metrics", "/version"):
                    assert r.status_code == 200
                else:
                    assert assert_error(r, 401)["code"] == "invalid_api_key", (method, path)
        # The key opens them (docs and schema included).
        good = {"Authorization": "Bearer k3y"}
        for path in ["/openapi.json", "/docs", "/v1/models", "/metrics", "/_test/state"]:
            assert httpx.get(s.base_url + path, headers=good).status_code == 200, path
