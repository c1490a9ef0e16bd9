"""API keys, the vLLM metric prefix, and a dead engine (503, /health unhealthy)."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from iterserve.metrics import METRIC_NAMES
from tests.server.helpers import MODEL, ServerThread
from tests.server.test_api import PROMPT, sse_events
from tests.server.test_errors import assert_error


def test_api_key_and_vllm_prefix(model_path):
    with ServerThread(model_path, api_key="sekret", metrics_prefix="vllm") as s:
        good = {"Authorization": "Bearer sekret"}
        # /health, /metrics and /version are open (as vLLM leaves them); the rest needs the key.
        for path in ("/health", "/metrics", "/version"):
            assert httpx.get(s.base_url + path).status_code == 200, path
        for method, path in [("GET", "/v1/models"),
                             ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                             ("POST", "/tokenize"), ("GET", "/nonexistent")]:
            for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}]:
                r = httpx.request(method, s.base_url + path, headers=headers, json={})
                assert assert_error(r, 401)["code"] == "invalid_api_key"
        c = openai.OpenAI(base_url=s.base_url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        c = openai.OpenAI(base_url=s.base_url + "/v1", api_key="sekret", max_retries=0)
        assert c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).choices
        # Prometheus text parses, every vLLM name is there under vllm:.
        text = httpx.get(s.base_url + "/metrics", headers=good).text
        names = {smp.name for fam in text_string_to_metric_families(text) for smp in fam.samples}
        for name in METRIC_NAMES:
            assert any(n.startswith(f"vllm:{name}") for n in names), name
        assert not any(n.startswith("iterserve:") for n in names)


def test_dead_engine_is_503_and_unhealthy(model_path):
    with ServerThread(model_path, enable_test_hooks=True) as s:
        url = s.base_url + "/v1/completions"
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True}
        results: dict[str, httpx.Response] = {}

        def call(name: str, b: dict) -> None:
            results[name] = httpx.post(url, json=b, timeout=30)

        # In-flight requests when the loop dies end with an error, never hang.
        s.engine.set_fault_hook(lambda _: time.sleep(0.01))
        threads = [threading.Thread(target=call, args=("plain", body)),
                   threading.Thread(target=call, args=("stream", {**body, "stream": True}))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while s.engine.num_unfinished_requests < 2:
            assert time.monotonic() < deadline, "requests never reached the engine"
            time.sleep(0.005)
        httpx.post(s.base_url + "/_test/fault", json={"kind": "kill"})
        for t in threads:
            t.join(30)
        assert assert_error(results["plain"], 503)["code"] == "engine_unavailable"
        events = sse_events(results["stream"].text)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_unavailable"

        assert_error(httpx.get(s.base_url + "/health"), 503)
        for stream in (False, True):
            r = httpx.post(url, json={**body, "stream": stream}, timeout=5)
            assert_error(r, 503)
        r = httpx.post(s.base_url + "/v1/chat/completions", timeout=5,
                       json={"messages": [{"role": "user", "content": "x"}]})
        assert_error(r, 503)
        # The process still answers: metrics say why.
        assert s.metric("engine_healthy") == 0
        assert s.metric("request_success_total", finished_reason="error") == 2
