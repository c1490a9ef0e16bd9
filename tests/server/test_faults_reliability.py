"""Faults under concurrency (extends test_errors / test_auth_health, which cover one
request each): a failing or hung step fails every request in it exactly once and frees
their blocks; the next requests are served as before; a dead engine answers 503 to
running, waiting and new requests alike. Plus X-Request-Id, and a stream whose client is
gone before its first byte (the admission reservation must not leak)."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from tests.server.helpers import MODEL, ServerThread
from tests.server.test_api import PROMPT, sse_events
from tests.server.test_errors import assert_error


def children_ended(server, prefix: str) -> dict[tuple[str, int], list[str]]:
    """The engine's finish log for requests whose X-Request-Id starts with prefix."""
    out: dict[tuple[str, int], list[str]] = {}
    for engine_id, index, reason in list(server.engine.finish_log):
        if engine_id.startswith(prefix):
            out.setdefault((engine_id.rsplit("-", 1)[0], index), []).append(reason)
    return out


def greedy(max_tokens: int = 12, **kw) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, **kw}


async def _post(c: httpx.AsyncClient, url: str, body: dict, rid: str) -> httpx.Response:
    return await c.post(url, json=body, headers={"X-Request-Id": rid})


def run_batch_with_fault(server, fault: dict, prefix: str) -> list[httpx.Response]:
    """Six requests (two n=2, two streaming) all running; then one step faults."""
    url = server.base_url + "/v1/completions"
    bodies = [greedy(200), greedy(200, n=2, temperature=0.5), greedy(200, stream=True),
              greedy(200, stream=True, n=2, temperature=0.5), greedy(200), greedy(200)]
    server.engine.set_fault_hook(lambda _: time.sleep(0.02))  # keep them in flight

    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as c:
            tasks = [asyncio.create_task(_post(c, url, b, f"{prefix}{i}"))
                     for i, b in enumerate(bodies)]
            deadline = time.monotonic() + 20
            # All 8 children running (max_num_seqs is 8) before the fault.
            while server.metric("num_requests_running") < 8:
                assert time.monotonic() < deadline, "the batch never formed"
                await asyncio.sleep(0.02)
            r = await c.post(server.base_url + "/_test/fault", json=fault)
            assert r.status_code == 200
            return await asyncio.gather(*tasks)

    try:
        return asyncio.run(go())
    finally:
        httpx.post(server.base_url + "/_test/fault", json={"kind": "none", "step_timeout_s": None})
        server.engine.set_fault_hook(None)


@pytest.mark.parametrize("fault", [
    {"kind": "raise", "count": 1},
    {"kind": "hang", "count": 1, "seconds": 1.0, "step_timeout_s": 0.3},
], ids=["raise", "hang"])
def test_faulty_step_fails_its_whole_batch_once(server, fault):
    want = httpx.post(server.base_url + "/v1/completions", json=greedy(), timeout=30).json()
    prefix = f"fault-{fault['kind']}-"
    before = server.metric("request_success_total", finished_reason="error")
    rs = run_batch_with_fault(server, fault, prefix)
    for i, r in enumerate(rs):
        if i in (2, 3):  # streams: 200, then an error event and [DONE]
            assert r.status_code == 200
            events = sse_events(r.text)
            assert events[-1] == "[DONE]"
            assert events[-2]["error"]["code"] == "engine_step_failed"
        else:
            assert assert_error(r, 500)["code"] == "engine_step_failed"
    # Every child of the step ended exactly once, with error; blocks are free.
    ended = children_ended(server, prefix)
    assert len(ended) == 8 and all(v == ["error"] for v in ended.values()), ended
    assert server.metric("request_success_total", finished_reason="error") == before + 8
    server.wait_idle()
    # The next requests are served as before: same greedy output.
    again = httpx.post(server.base_url + "/v1/completions", json=greedy(), timeout=30).json()
    assert again["choices"][0]["text"] == want["choices"][0]["text"]
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_fault_mid_stream_after_tokens(server):
    """Tokens already sent stay sent; the error arrives as an event, then [DONE]."""
    url = server.base_url + "/v1/completions"
    server.engine.set_fault_hook(lambda _: time.sleep(0.01))
    try:
        with httpx.Client(timeout=30) as c, \
                c.stream("POST", url, json=greedy(100, stream=True)) as r:
            lines = r.iter_lines()
            got = [next(line for line in lines if line.startswith("data:")) for _ in range(3)]
            httpx.post(server.base_url + "/_test/fault", json={"kind": "raise", "count": 1})
            rest = "\n".join(lines)
    finally:
        httpx.post(server.base_url + "/_test/fault", json={"kind": "none"})
        server.engine.set_fault_hook(None)
    events = sse_events("\n".join(got) + "\n" + rest)
    assert events[0]["choices"][0]["text"]
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_step_failed"
    server.wait_idle()


def test_dead_engine_fails_running_and_waiting(model_path):
    """With more requests than max_num_seqs (some waiting), a dead engine loop ends every
    one of them with 503 / an error event, exactly once; nothing hangs."""
    with ServerThread(model_path, enable_test_hooks=True,
                      engine_args={"max_num_seqs": 2}) as s:
        url = s.base_url + "/v1/completions"
        results: dict[int, httpx.Response] = {}

        def call(i: int) -> None:
            body = greedy(200, stream=i % 2 == 1, n=2 if i == 4 else 1,
                          temperature=0.5 if i == 4 else 0.0)
            results[i] = httpx.post(url, json=body, headers={"X-Request-Id": f"dead-{i}"},
                                    timeout=30)

        s.engine.set_fault_hook(lambda _: time.sleep(0.01))
        threads = [threading.Thread(target=call, args=(i,)) for i in range(5)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while s.engine.num_unfinished_requests < 6:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert s.metric("num_requests_waiting") > 0
        t0 = time.monotonic()
        httpx.post(s.base_url + "/_test/fault", json={"kind": "kill"})
        for t in threads:
            t.join(30)
        assert time.monotonic() - t0 < 10, "requests hung after the engine died"
        for i, r in results.items():
            if i % 2:
                events = sse_events(r.text)
                assert events[-1] == "[DONE]"
                assert events[-2]["error"]["code"] == "engine_unavailable"
            else:
                assert assert_error(r, 503)["code"] == "engine_unavailable"
        ended = children_ended(s, "dead-")
        assert len(ended) == 6 and all(v == ["error"] for v in ended.values()), ended
        assert s.engine.num_unfinished_requests == 0
        assert_error(httpx.get(s.base_url + "/health", timeout=1), 503)
        t0 = time.monotonic()
        assert_error(httpx.post(url, json=greedy(), timeout=5), 503)
        assert time.monotonic() - t0 < 1.0


def test_request_id_header(server):
    url = server.base_url + "/v1/completions"
    r = httpx.post(url, json=greedy(3), headers={"X-Request-Id": "my-req.1"}, timeout=30)
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "my-req.1" and r.json()["id"] == "cmpl-my-req.1"
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=30,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                         "stream": True}, headers={"X-Request-Id": "chat-7"})
    events = sse_events(r.text)
    assert r.headers["x-request-id"] == "chat-7"
    assert all(e["id"] == "chatcmpl-chat-7" for e in events[:-1])
    # Without one, the server picks an id and still echoes it.
    r = httpx.post(url, json=greedy(2), timeout=30)
    assert r.json()["id"] == "cmpl-" + r.headers["x-request-id"]
    # A bad one is a 400 naming the header; two clients picking the same id both run.
    for bad in ["has space", "x" * 129, "semi;colon"]:
        r = httpx.post(url, json=greedy(2), headers={"X-Request-Id": bad})
        assert assert_error(r, 400, "X-Request-Id")

    async def twins() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as c:
            return await asyncio.gather(*(_post(c, url, greedy(8), "twin") for _ in range(3)))

    rs = asyncio.run(twins())
    assert [r.status_code for r in rs] == [200] * 3
    assert len({r.json()["choices"][0]["text"] for r in rs}) == 1
    server.wait_idle()


def test_stream_client_gone_before_first_byte(server):
    """The client leaves while its stream request is still being tokenized, so it is
    gone before the response starts. The admission reservation must still be released
    (a leak would shrink capacity for good)."""
    tok = server.app.state.serving.tokenization
    encode, encode_chat = tok.encode, tok.encode_chat

    async def slow_encode(*a, **kw):
        await asyncio.sleep(0.4)
        return await encode(*a, **kw)

    async def slow_encode_chat(*a, **kw):
        await asyncio.sleep(0.4)
        return await encode_chat(*a, **kw)

    tok.encode, tok.encode_chat = slow_encode, slow_encode_chat
    try:
        for api, body in [("/v1/completions", greedy(5, stream=True)),
                          ("/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "x"}], "stream": True,
                            "max_tokens": 5})]:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(server.base_url + api, json=body, timeout=0.1)
        time.sleep(0.8)
    finally:
        tok.encode, tok.encode_chat = encode, encode_chat
    server.wait_idle()
    assert server.app.state.serving.admission.num_requests == 0


def test_stream_released_when_the_first_send_fails(server):
    """ASGI spec 2.4: the response's first send raises for a gone client, before the body
    generator starts; the reservation is released all the same."""
    from starlette.requests import ClientDisconnect

    released: list[int] = []
    started: list[int] = []

    class FakeReservation:
        def release(self) -> None:
            released.append(1)

    async def chunks():
        started.append(1)
        yield "data: x\n\n"

    async def receive():
        return {"type": "http.disconnect"}

    async def send(_):
        raise OSError("gone")

    resp = server.app.state.serving.stream(chunks(), FakeReservation(), "no-such-id", "x")
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}}
    with pytest.raises(ClientDisconnect):
        asyncio.run(resp(scope, receive, send))
    assert started == [] and released == [1]
