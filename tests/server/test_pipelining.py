"""HTTP/1.1 pipelining over a raw socket: answers in order; a connection closed (or
half-closed: a client that left) with requests queued or running ends them quietly,
aborted, with no tracebacks."""

from __future__ import annotations

import json
import socket
import time

import pytest

from iterserve.entrypoints.http_protocol import (
    MAX_PIPELINED_REQUESTS,
    PipelinedHttpToolsProtocol,
    http_protocol,
)
from tests.server.helpers import MODEL
from tests.server.test_hostile_input import captured_logs, tracebacks

pytestmark = pytest.mark.timeout(120)


def post(path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()


def completion(max_tokens: int, **kw) -> bytes:
    return post("/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": max_tokens,
                                    "ignore_eos": True, **kw})


class Reader:
    """Parses HTTP/1.1 responses off a socket, one after another."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""
        self.eof = False

    def _fill(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            self.eof = True
            raise EOFError
        self.buf += data

    def _until(self, sep: bytes) -> bytes:
        while sep not in self.buf:
            self._fill()
        head, self.buf = self.buf.split(sep, 1)
        return head

    def _take(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def response(self) -> tuple[int, dict[str, str], bytes]:
        lines = self._until(b"\r\n\r\n").decode().split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, v in (h.split(":", 1) for h in lines[1:])}
        if headers.get("transfer-encoding") == "chunked":
            body = b""
            while size := int(self._until(b"\r\n"), 16):
                body += self._take(size)
                self._take(2)
            self._take(2)
        else:
            body = self._take(int(headers.get("content-length", "0")))
        return status, headers, body

    def closed(self, timeout: float = 10.0) -> bool:
        """True when the server closes the connection with nothing more to send."""
        self.sock.settimeout(timeout)
        try:
            self._fill()
        except EOFError:
            return not self.buf
        except TimeoutError:
            return False
        return False


def connect(server) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def test_the_server_runs_the_pipelining_safe_protocol():
    assert PipelinedHttpToolsProtocol is not None, "httptools is a dependency (uvicorn[standard])"
    assert http_protocol() is PipelinedHttpToolsProtocol


def test_pipelined_requests_are_answered_in_order(server):
    with captured_logs() as records, connect(server) as s:
        s.sendall(completion(3) + get("/health") + completion(5, stream=True)
                  + get("/version") + completion(2))
        r = Reader(s)
        status, _, body = r.response()
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 3
        assert r.response()[0] == 200  # /health, empty
        status, headers, body = r.response()
        assert status == 200 and headers["content-type"].startswith("text/event-stream")
        events = [e for e in body.decode().split("\n\n") if e]
        assert events[-1] == "data: [DONE]" and len(events) == 5 + 1
        status, _, body = r.response()
        assert status == 200 and "version" in json.loads(body)
        status, _, body = r.response()
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 2
        # Keep-alive: the connection still serves.
        s.sendall(get("/health"))
        assert r.response()[0] == 200
    assert tracebacks(records) == []


def test_a_half_closed_connection_is_a_client_that_left(server):
    """The client's FIN cannot be told from a full close until a write fails, and a
    non-streamed answer writes nothing until it is done: its requests are aborted at once
    (as uvicorn and nginx do), quietly."""
    server.engine.set_fault_hook(lambda _: time.sleep(0.01))
    before = server.metric("request_success_total", finished_reason="abort")
    try:
        with captured_logs() as records, connect(server) as s:
            s.sendall(completion(100) + completion(6, stream=True) + get("/health"))
            time.sleep(0.2)  # the first is running
            s.shutdown(socket.SHUT_WR)
            assert Reader(s).closed()
        server.wait_idle()
    finally:
        server.engine.set_fault_hook(None)
    assert tracebacks(records) == []
    assert server.metric("request_success_total", finished_reason="abort") == before + 1


def test_a_request_cut_off_by_the_eof_closes_the_connection(server):
    with captured_logs() as records, connect(server) as s:
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n")
        s.sendall(head + b'{"model": ')
        s.shutdown(socket.SHUT_WR)
        assert Reader(s).closed()
    assert tracebacks(records) == []
    server.wait_idle()


@pytest.mark.parametrize("stream", [False, True])
def test_closing_with_requests_queued_logs_no_traceback(server, stream):
    """The client pipelines many long requests and hangs up once the first answer starts:
    the one running is aborted, the queued ones never start, nothing is logged."""
    server.engine.set_fault_hook(lambda _: time.sleep(0.005))
    try:
        with captured_logs() as records:
            for _ in range(3):
                with connect(server) as s:
                    s.sendall(completion(60, stream=stream) * 20)
                    if stream:
                        s.recv(1)  # the first answer has started
                    else:
                        time.sleep(0.1)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and server.metric("num_requests_running"):
                time.sleep(0.05)
            time.sleep(0.3)  # any write to the closed transports has happened by now
        assert tracebacks(records) == []
        server.wait_idle()
        with connect(server) as s:
            s.sendall(get("/health"))
            assert Reader(s).response()[0] == 200
    finally:
        server.engine.set_fault_hook(None)


def test_the_pipeline_is_bounded(server):
    """Up to the cap, every pipelined request is answered in order; past it the
    connection is closed (a client streaming requests grew uvicorn's queue unbounded)."""
    n = MAX_PIPELINED_REQUESTS
    with captured_logs() as records:
        with connect(server) as s:
            s.sendall(completion(1) + get("/health") * n)
            r = Reader(s)
            assert r.response()[0] == 200
            assert [r.response()[0] for _ in range(n)] == [200] * n
        server.engine.set_fault_hook(lambda _: time.sleep(0.05))
        try:
            with connect(server) as s:
                s.sendall(completion(50) + get("/health") * (3 * n))
                r = Reader(s)
                with pytest.raises(EOFError):
                    for _ in range(3 * n + 1):
                        r.response()
        finally:
            server.engine.set_fault_hook(None)
        server.wait_idle()
    assert tracebacks(records) == []
    with connect(server) as s:
        s.sendall(get("/health"))
        assert Reader(s).response()[0] == 200
