"""HTTP/1.1 pipelining served in order, whatever the client does with its socket.

uvicorn's httptools protocol queues pipelined requests and answers them in order, but
two cases go wrong:

- **The client closes while requests are queued.** uvicorn marks only the newest request
  (still queued) as disconnected; the one being answered keeps writing to the closed
  transport, and under uvloop every write raises ``RuntimeError: ... the handler is
  closed`` (two tracebacks per request, one from the app's error handler and one from
  uvicorn). Its ``receive()`` never reports the disconnect either, so a streamed answer
  runs to its end for nobody.
- **The client half-closes** (sends its requests, then ``shutdown(SHUT_WR)``, as
  ``printf ... | nc`` does). asyncio closes the transport on EOF, so nothing is answered.

``PipelinedHttpToolsProtocol`` marks every unanswered request disconnected when the
connection is lost (each then ends quietly: its ``receive()`` says ``http.disconnect``
and its ``send()`` writes nothing), and on a half-close keeps the connection open for
writing until the requests already received are answered, then closes it. A request cut
off mid-body by the EOF cannot be answered: the connection closes at once.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("iterserve.server")

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools not installed: uvicorn's h11 protocol is used
    HttpToolsProtocol = None  # type: ignore[assignment, misc]


def http_protocol() -> Any:
    """uvicorn's ``http`` setting: the pipelining-safe httptools protocol, or ``"h11"``
    (which serves one request at a time and closes cleanly) without httptools."""
    return PipelinedHttpToolsProtocol if PipelinedHttpToolsProtocol is not None else "h11"


if HttpToolsProtocol is not None:

    class _Protocol(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._open_cycles: list[Any] = []  # every request not yet fully answered
            self._read_eof = False

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            self._open_cycles = [c for c in self._open_cycles if not c.response_complete]
            if self.cycle is not None:
                self._open_cycles.append(self.cycle)

        def connection_lost(self, exc: Exception | None) -> None:
            for cycle in self._open_cycles:
                if not cycle.response_complete:
                    cycle.disconnected = True
                    cycle.message_event.set()
            self._open_cycles = []
            self.pipeline.clear()  # queued requests are never started
            super().connection_lost(exc)

        def eof_received(self) -> bool | None:  # type: ignore[override]
            pending = any(not c.response_complete for c in self._open_cycles)
            complete = self.cycle is None or not self.cycle.more_body
            if pending and complete:
                # Keep the write side open: what was received gets its answers.
                self._read_eof = True
                return True
            return None  # asyncio closes the transport

        def on_response_complete(self) -> None:
            super().on_response_complete()
            done = not self.pipeline and all(c.response_complete for c in self._open_cycles)
            if self._read_eof and done and not self.transport.is_closing():
                self.transport.close()

    PipelinedHttpToolsProtocol: Any = _Protocol
else:  # pragma: no cover
    PipelinedHttpToolsProtocol = None
