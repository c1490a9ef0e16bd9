"""The slo policy through the API: per-request targets, a bad target is a 400 naming the
field, and --slo-admission refuses an unattainable target with a 429 (OpenAI's shape)."""

from __future__ import annotations

import httpx
import pytest

from tests.server.helpers import MODEL, ServerThread
from tests.server.test_errors import assert_error


@pytest.fixture(scope="module")
def slo_server(model_path):
    with ServerThread(model_path, engine_args={"scheduling_policy": "slo", "slo_admission": True,
                                               "ttft_slo_ms": 60_000.0}) as s:
        yield s


def test_attainable_targets_are_served(slo_server):
    url = slo_server.base_url + "/v1/completions"
    r = httpx.post(url, json={"model": MODEL, "prompt": "hello", "max_tokens": 2,
                              "ttft_slo_ms": 60_000, "tpot_slo_ms": 10_000}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_an_unattainable_ttft_target_is_refused_with_429(slo_server, endpoint):
    body = {"model": MODEL, "max_tokens": 2, "ttft_slo_ms": 1e-6}
    if "chat" in endpoint:
        body["messages"] = [{"role": "user", "content": "hello there"}]
    else:
        body["prompt"] = "hello there"
    err = assert_error(httpx.post(slo_server.base_url + endpoint, json=body, timeout=60), 429,
                       "ttft_slo_ms")
    assert err["type"] == "rate_limit_error"
    assert "ttft_slo_ms" in err["message"]


@pytest.mark.parametrize("value", [0, -5])
def test_a_bad_target_is_a_400_naming_the_field(slo_server, value):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "tpot_slo_ms": value}
    err = assert_error(httpx.post(slo_server.base_url + "/v1/completions", json=body, timeout=60),
                       400, "tpot_slo_ms")
    assert "tpot_slo_ms" in err["message"]
