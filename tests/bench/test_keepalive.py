"""bench serve against a server that closes keep-alive connections (as llama.cpp's does):
a request whose reused connection closed before any response is resent, not counted as
failed; a request whose response had begun, or whose connection was new, is never resent.

The server is raw asyncio HTTP/1.1 so the test decides exactly when a connection
closes: after ``per_connection`` answered requests it reads the next request on that
connection and closes without a byte of response (the race a keep-alive timeout makes
deterministic)."""

from __future__ import annotations

import asyncio
import json

from iterserve.bench.datasets import SampleRequest
from iterserve.bench.serve import BenchConfig, run_benchmark

_CHUNKS = [
    {"choices": [{"index": 0, "text": "a", "finish_reason": None}]},
    {"choices": [{"index": 0, "text": "b", "finish_reason": "length"}],
     "usage": {"prompt_tokens": 3, "completion_tokens": 2}},
]
_BODY = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in _CHUNKS) \
    + b"data: [DONE]\n\n"


class ClosingServer:
    """Answers ``per_connection`` requests per connection, then closes the connection
    on the next one unanswered. A prompt holding ``half`` gets half of its response,
    then the connection closes."""

    def __init__(self, per_connection: int) -> None:
        self.per_connection = per_connection
        self.received: list[str] = []  # prompts, in arrival order (resends included)
        self.connections = 0
        self.port = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> ClosingServer:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        answered = 0
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                prompt = json.loads(await reader.readexactly(length))["prompt"]
                self.received.append(prompt)
                if answered == self.per_connection:
                    return  # the keep-alive policy: closed, the request unanswered
                answered += 1
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(_BODY))
                if "half" in prompt:
                    writer.write(_BODY[: len(_BODY) // 2])
                    await writer.drain()
                    return  # the response had begun: the client must count a failure
                writer.write(_BODY)
                await writer.drain()
        finally:
            writer.close()


async def _bench(per_connection: int, prompts: list[str], **cfg: object):
    async with ClosingServer(per_connection) as server:
        config = BenchConfig(base_url=f"http://127.0.0.1:{server.port}", model="m",
                             max_concurrency=1, disable_tqdm=True, **cfg)  # type: ignore[arg-type]
        reqs = [SampleRequest(prompt=p, prompt_len=3, expected_output_len=2) for p in prompts]
        records, _, _ = await run_benchmark(reqs, config, verbose=False)
    return server, records


def test_a_request_lost_on_a_reused_connection_is_resent_not_failed():
    prompts = [f"p{i}" for i in range(10)]
    server, records = asyncio.run(_bench(2, prompts))
    assert all(r.success for r in records), [r.error for r in records]
    # Every third request found its (reused) connection closed, once each: p2, p4, p6, p8.
    assert [r.retries for r in records] == [0, 0, 1, 0, 1, 0, 1, 0, 1, 0]
    assert server.received == ["p0", "p1", "p2", "p2", "p3", "p4", "p4", "p5", "p6", "p6",
                               "p7", "p8", "p8", "p9"]
    assert all(r.output_len == 2 for r in records)


def test_a_response_that_began_is_never_resent():
    server, records = asyncio.run(_bench(5, ["p0", "half p1", "p2"]))
    assert [r.success for r in records] == [True, False, True]
    assert records[1].error_code == "connection" and records[1].retries == 0
    assert server.received == ["p0", "half p1", "p2"]  # sent once


def test_a_new_connection_closed_unanswered_is_a_failure():
    server, records = asyncio.run(_bench(0, ["p0", "p1"]))
    assert [(r.success, r.error_code, r.retries) for r in records] == \
        [(False, "connection", 0)] * 2
    assert server.received == ["p0", "p1"]


def test_disable_keep_alive_opens_a_connection_per_request():
    server, records = asyncio.run(_bench(1, [f"p{i}" for i in range(4)],
                                         disable_keep_alive=True))
    assert all(r.success and r.retries == 0 for r in records)
    assert server.connections == 4 and len(server.received) == 4
