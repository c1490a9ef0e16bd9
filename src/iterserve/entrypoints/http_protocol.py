"""HTTP/1.1 pipelining served in order, and a connection closed with requests pending
ended quietly.

uvicorn's httptools protocol queues pipelined requests and answers them in order, but
when the client closes the connection while requests are queued it marks only the
newest (still queued) as disconnected: the one being answered keeps writing to the
closed transport, and under uvloop every write raises ``RuntimeError: ... the handler
is closed`` (two tracebacks per request, one from the app's error handler and one from
uvicorn); its ``receive()`` never reports the disconnect either, so its generation runs
to the end for nobody.

``PipelinedHttpToolsProtocol`` marks every unanswered request disconnected when the
connection is lost: the running one sees ``http.disconnect`` (the server aborts it) and
its ``send()`` writes nothing; the queued ones never start.

The queue is bounded: a connection with more than ``MAX_PIPELINED_REQUESTS`` requests
waiting behind the one being answered is closed (its requests aborted as above). uvicorn
pauses reading while requests queue, but each ``receive()`` of the running request
resumes it, so a client streaming pipelined requests could grow the queue without bound.

A half-close (the client's FIN after its requests, as ``printf ... | nc`` sends) is a
client that left, as uvicorn and nginx take it: a server cannot tell it from a full
close until a write fails, and a non-streamed answer writes nothing until it is done,
so keeping the connection would hold a departed client's generation to its end.
"""

from __future__ import annotations

from typing import Any

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools not installed: uvicorn's h11 protocol is used
    HttpToolsProtocol = None  # type: ignore[assignment, misc]


# Requests queued behind the one being answered, per connection.
MAX_PIPELINED_REQUESTS = 128


def http_protocol() -> Any:
    """uvicorn's ``http`` setting: the pipelining-safe httptools protocol, or ``"h11"``
    (which serves one request at a time and closes cleanly) without httptools."""
    return PipelinedHttpToolsProtocol if PipelinedHttpToolsProtocol is not None else "h11"


if HttpToolsProtocol is not None:

    class _Protocol(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._open_cycles: list[Any] = []  # every request not yet fully answered

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            self._open_cycles = [c for c in self._open_cycles if not c.response_complete]
            if self.cycle is not None:
                self._open_cycles.append(self.cycle)
            if len(self.pipeline) > MAX_PIPELINED_REQUESTS and not self.transport.is_closing():
                self.transport.close()  # connection_lost ends every request it holds

        def connection_lost(self, exc: Exception | None) -> None:
            for cycle in self._open_cycles:
                if not cycle.response_complete:
                    cycle.disconnected = True
                    cycle.message_event.set()
            self._open_cycles = []
            self.pipeline.clear()  # queued requests are never started
            super().connection_lost(exc)

    PipelinedHttpToolsProtocol: Any = _Protocol
else:  # pragma: no cover
    PipelinedHttpToolsProtocol = None
