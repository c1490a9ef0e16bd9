"""Admission control under a burst, and clients that go away mid-request."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from iterserve.metrics import METRIC_NAMES
from tests.server.helpers import MODEL, ServerThread
from tests.server.test_api import PROMPT


def slow_steps(server, seconds: float = 0.01) -> None:
    """Each step sleeps first, so requests stay in flight long enough to overlap."""
    server.engine.set_fault_hook(lambda _: time.sleep(seconds))


def body(max_tokens: int = 40, **kw) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True,
            **kw}


async def burst(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=60) as c:
        return await asyncio.gather(*(c.post(url, json=b) for b in bodies))


@pytest.fixture(scope="module")
def capped(model_path):
    with ServerThread(model_path, max_num_queued_requests=4, max_num_queued_tokens=600) as s:
        yield s


def test_burst_admits_exactly_the_cap(capped):
    slow_steps(capped)
    try:
        url = capped.base_url + "/v1/completions"
        before = capped.metric("admission_rejections_total", reason="max_num_queued_reqs")
        rs = asyncio.run(burst(url, [body(30) for _ in range(12)]))
    finally:
        capped.engine.set_fault_hook(None)
    codes = sorted(r.status_code for r in rs)
    assert codes == [200] * 4 + [429] * 8
    for r in rs:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "queue_full"
    after = capped.metric("admission_rejections_total", reason="max_num_queued_reqs")
    assert after - before == 8
    capped.wait_idle()


def test_n_counts_n_and_token_cap(capped):
    slow_steps(capped)
    url = capped.base_url + "/v1/completions"
    try:
        with httpx.Client(timeout=60) as c, \
                c.stream("POST", url, json=body(60, n=3, stream=True)) as s:
            lines = s.iter_lines()  # (keep the iterator: dropping it closes the connection)
            next(lines)  # admitted: 3 of the 4 sequence slots are held
            r = c.post(url, json=body(5, n=2))
            assert r.status_code == 429
        capped.engine.set_fault_hook(None)  # 240-token requests overlap a burst anyway
        capped.wait_idle()
        # Tokens: (prompt + max_tokens) per sequence against a cap of 600.
        before = capped.metric("admission_rejections_total", reason="max_num_queued_tokens")
        rs = asyncio.run(burst(url, [body(240) for _ in range(3)]))
        assert sorted(r.status_code for r in rs) == [200, 200, 429]
        assert capped.metric("admission_rejections_total", reason="max_num_queued_tokens") == before + 1
        # A request bigger than the cap itself can never run: 400, not 429.
        r = httpx.post(url, json=body(200, n=4))
        assert r.status_code == 400
    finally:
        capped.engine.set_fault_hook(None)
    # Refusal status is configurable (some load balancers only retry 503).
    capped.app.state.serving.admission.status_code = 503
    try:
        slow_steps(capped)
        rs = asyncio.run(burst(url, [body(30) for _ in range(6)]))
        assert sorted(r.status_code for r in rs) == [200] * 4 + [503] * 2
    finally:
        capped.engine.set_fault_hook(None)
        capped.app.state.serving.admission.status_code = 429
    capped.wait_idle()


def test_dropped_streams_leave_nothing_behind(server):
    slow_steps(server)
    before = server.metric("request_success_total", finished_reason="abort")
    url = server.base_url + "/v1/completions"
    try:
        clients = [httpx.Client(timeout=30) for _ in range(4)]
        streams = []
        for i, c in enumerate(clients):
            api = "/v1/chat/completions" if i % 2 else "/v1/completions"
            b = ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
                  "ignore_eos": True, "stream": True} if i % 2 else body(200, stream=True))
            cm = c.stream("POST", server.base_url + api, json=b)
            s = cm.__enter__()
            lines = s.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            streams.append((cm, lines))
        assert server.metric("num_requests_running") + server.metric("num_requests_waiting") > 0
        for (cm, _), c in zip(streams, clients):
            cm.__exit__(None, None, None)
            c.close()
        # A non-streaming client that gives up (timeout) is aborted too.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url, json=body(200), timeout=0.5)
        server.wait_idle()
    finally:
        server.engine.set_fault_hook(None)
    assert server.metric("request_success_total", finished_reason="abort") == before + 5
    assert server.engine.num_unfinished_requests == 0


def test_metrics_names_and_counters(server):
    m = server.metrics()
    for name in METRIC_NAMES:
        assert any(k.startswith(f"iterserve:{name}") for k in m), name
    before = server.metrics()
    prompt_len = httpx.post(server.base_url + "/tokenize", json={"prompt": PROMPT}).json()["count"]
    url = server.base_url + "/v1/completions"
    for i in range(3):
        r = httpx.post(url, json=body(5, stream=bool(i % 2), temperature=0), timeout=30)
        assert r.status_code == 200
    server.wait_idle()
    after = server.metrics()

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("iterserve:request_success_total{finished_reason=length}") == 3
    assert delta("iterserve:generation_tokens_total") == 15
    assert delta("iterserve:prompt_tokens_total") == 3 * prompt_len
    assert delta("iterserve:time_to_first_token_seconds_count") == 3
    assert delta("iterserve:e2e_request_latency_seconds_count") == 3
    assert delta("iterserve:request_queue_time_seconds_count") == 3
    assert delta("iterserve:inter_token_latency_seconds_count") == 3 * 4
    assert delta("iterserve:iteration_tokens_total_sum") >= 3 * (prompt_len + 4)
    assert delta("iterserve:prefix_cache_queries_total") >= 3 * prompt_len - 3
