"""A stub OpenAI-compatible streaming server with known delays, for bench tests.

It runs in its own thread and event loop on a free 127.0.0.1 port. Each request
streams ``max_tokens`` one-token chunks: the first after ``ttft`` seconds, the
rest ``itl`` seconds apart. A prompt may override the defaults with
``key=value`` words, e.g. ``"ttft=0.3 itl=0.01 mode=429"``. Modes:
``ok``, ``429``, ``500``, ``drop`` (close the connection after 2 tokens),
``error_event`` (an error event after 1 token), ``nousage`` (no usage chunk).
The stub counts the requests in flight and keeps the most it ever saw.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

from aiohttp import web


class StubServer:
    def __init__(self, ttft: float = 0.05, itl: float = 0.01, mode: str = "ok") -> None:
        self.defaults: dict[str, Any] = {"ttft": ttft, "itl": itl, "mode": mode}
        self.in_flight = 0
        self.max_in_flight = 0
        self.num_requests = 0
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- lifecycle ---------------------------------------------------------------
    def start(self) -> StubServer:
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._start())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("stub server did not start")
        return self

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    def stop(self) -> None:
        if self._loop is None:
            return
        fut = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
        fut.result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> StubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- handlers ----------------------------------------------------------------
    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "stub-model"}]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._stream(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._stream(request, chat=True)

    def _settings(self, prompt: Any) -> dict[str, Any]:
        s = dict(self.defaults)
        if isinstance(prompt, str):
            for word in prompt.split():
                key, sep, value = word.partition("=")
                if sep and key in s:
                    s[key] = value if key == "mode" else float(value)
        return s

    async def _stream(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        self.num_requests += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            prompt = body["messages"][-1]["content"] if chat else body["prompt"]
            s = self._settings(prompt)
            if s["mode"] in ("429", "500"):
                status = int(s["mode"])
                return web.json_response(
                    {"error": {"message": "stub says no", "type": "stub", "param": None,
                               "code": status}},
                    status=status,
                    headers={"Retry-After": "1"} if status == 429 else None,
                )
            n = int(body.get("max_tokens") or 16)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            start = time.perf_counter()
            obj = "chat.completion.chunk" if chat else "text_completion"

            async def send(payload: dict[str, Any]) -> None:
                await resp.write(f"data: {json.dumps(payload)}\n\n".encode())

            def choice(text: str, finish: str | None) -> dict[str, Any]:
                if chat:
                    return {"index": 0, "delta": {"content": text}, "finish_reason": finish}
                return {"index": 0, "text": text, "finish_reason": finish}

            if chat:  # role-only first chunk, no text: must not count as the first token
                await send({"object": obj, "choices": [
                    {"index": 0, "delta": {"role": "assistant", "content": ""},
                     "finish_reason": None}]})
            for i in range(n):
                # Sleep to an absolute deadline so delays do not accumulate drift.
                target = start + s["ttft"] + i * s["itl"]
                await asyncio.sleep(max(0.0, target - time.perf_counter()))
                finish = "length" if i == n - 1 else None
                await send({"object": obj, "choices": [choice(f" t{i}", finish)]})
                if s["mode"] == "drop" and i == 1:
                    request.transport.close()
                    return resp
                if s["mode"] == "error_event" and i == 0:
                    await send({"error": {"message": "engine failed", "type": "stub",
                                          "code": 500}})
                    await resp.write(b"data: [DONE]\n\n")
                    return resp
            if s["mode"] != "nousage" and (body.get("stream_options") or {}).get("include_usage"):
                # Byte-level counting, like iterserve's built-in model.
                prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.encode())
                await send({"object": obj, "choices": [], "usage": {
                    "prompt_tokens": prompt_tokens, "completion_tokens": n,
                    "total_tokens": prompt_tokens + n}})
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            self.in_flight -= 1
