"""The engine thread: ``EngineCore`` stepped on a background thread for ``AsyncLLM``.

The thread owns the EngineCore (scheduler, executor); nothing else touches it.
Requests, aborts and stop-string finishes reach it as typed messages through an
inbox drained between steps, so a step never sees the request set change under it.
Each step's outputs go back to the event loop with one ``call_soon_threadsafe``.

Failure model: a step that raises finishes the requests of that step with ``error``
and the thread goes on serving the rest; an exception anywhere else in the loop
kills it (``dead_error`` is set and ``on_dead`` runs on the loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from iterserve.core.outputs import EngineCoreOutputs
from iterserve.core.request import Request, RequestStatus
from iterserve.metrics import Metrics, SchedulerSnapshot

logger = logging.getLogger("iterserve.async_llm")


# -- the inbox's messages --------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class AddRequests:
    """Queue these child requests; any the scheduler refuses come back through
    ``on_rejected`` (child id -> the ValueError)."""

    requests: list[Request]


@dataclass(slots=True, frozen=True)
class AbortRequests:
    """Abort these child requests (unknown or finished ids are ignored)."""

    request_ids: list[str]


@dataclass(slots=True, frozen=True)
class FinishRequests:
    """Finish these child requests with ``status``: the output processor ended them
    (a stop string), the scheduler must free them before its next step."""

    request_ids: list[str]
    status: RequestStatus = RequestStatus.FINISHED_STOPPED


@dataclass(slots=True, frozen=True)
class Shutdown:
    """Stop the engine thread (after what is already in the inbox)."""


InboxMessage = AddRequests | AbortRequests | FinishRequests | Shutdown


def fail_step(core: Any, exc: Exception) -> EngineCoreOutputs:
    """Finish the requests of a step that raised outside the executor with ``error``.

    (EngineCore already turns an executor failure into ``error`` outputs; this is the
    net for a failure in schedule/update.) The step's requests are known when the
    scheduler got that far; otherwise every running request is suspect.
    """
    sched_out = core.last_scheduler_output
    ids = [r.request_id for r in sched_out.scheduled_requests] if sched_out else []
    ids = ids or [r.request_id for r in core.scheduler.running]
    # Nothing running to blame (schedule() itself fails): fail everything, or the
    # loop would spin on the same error with the waiting requests never answered.
    ids = ids or list(core.scheduler.requests)
    outputs = EngineCoreOutputs()
    for o in core.fail_requests(ids, f"{type(exc).__name__}: {exc}"):
        outputs.add_final(o)
    return outputs


class EngineCoreThread:
    """Runs ``engine_core`` on a daemon thread; callbacks run on ``loop``.

    ``on_outputs(outputs, now)``: one step's ``EngineCoreOutputs`` and the time the
    step ended; ``on_rejected({child id: ValueError})``; ``on_dead(exception)``.
    """

    def __init__(
        self,
        engine_core: Any,
        metrics: Metrics,
        *,
        on_outputs: Callable[[EngineCoreOutputs, float], None],
        on_rejected: Callable[[dict[str, ValueError]], None],
        on_dead: Callable[[BaseException], None],
    ) -> None:
        self.engine_core = engine_core
        self.metrics = metrics
        self.on_outputs = on_outputs
        self.on_rejected = on_rejected
        self.on_dead = on_dead
        self.dead_error: BaseException | None = None
        self._inbox: queue.SimpleQueue[InboxMessage] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="iterserve-engine", daemon=True)
        self._thread.start()

    def send(self, message: InboxMessage) -> None:
        """Hand ``message`` to the engine thread (any thread may call this)."""
        self._inbox.put(message)

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self.dead_error is None and self._thread is not None and self._thread.is_alive()

    # -- on the engine thread ------------------------------------------------------------

    def _run(self) -> None:
        core = self.engine_core
        try:
            while True:
                if not self._drain_inbox(block=not core.has_unfinished_requests()):
                    return
                if core.has_unfinished_requests():
                    self._step()
        except BaseException as e:  # the loop is dead: tell everyone waiting
            logger.exception("engine loop died")
            self.dead_error = e
            self.metrics.engine_healthy.set(0)
            self._call_soon(self.on_dead, e)

    def _drain_inbox(self, block: bool) -> bool:
        """Apply queued messages; False when asked to stop."""
        try:
            msg = self._inbox.get() if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        rejected: dict[str, ValueError] = {}
        core = self.engine_core
        while True:
            if isinstance(msg, Shutdown):
                return False
            if isinstance(msg, AddRequests):
                for req in msg.requests:
                    try:
                        core.add_request(req)
                    except ValueError as e:
                        rejected[req.request_id] = e
            elif isinstance(msg, AbortRequests):
                core.abort_requests(msg.request_ids)
            elif isinstance(msg, FinishRequests):
                core.finish_requests(msg.request_ids, msg.status)
            else:
                raise TypeError(f"unknown inbox message {msg!r}")
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                break
        self.metrics.observe_step(self._snapshot(), 0)
        if rejected:
            self._call_soon(self.on_rejected, rejected)
        return True

    def _step(self) -> None:
        core = self.engine_core
        try:
            outputs = core.step()
        except Exception as e:
            logger.exception("engine step failed; failing the requests it held")
            outputs = fail_step(core, e)
        sched_out = core.last_scheduler_output
        num_tokens = sched_out.total_num_scheduled_tokens if sched_out is not None else 0
        self.metrics.observe_step(self._snapshot(), num_tokens)
        if outputs:
            self._call_soon(self.on_outputs, outputs, time.monotonic())

    def _snapshot(self) -> SchedulerSnapshot:
        # Read live state rather than scheduler.stats: stats are taken in schedule(),
        # before the step's finishes, and the gauges must read 0 once the engine drains.
        sched = self.engine_core.scheduler
        kv = sched.kv
        spec = sched.spec.stats if sched.spec is not None else None
        snap = SchedulerSnapshot(
            num_running=len(sched.running),
            num_waiting=sched.num_waiting,
            kv_cache_usage=kv.usage,
            num_free_blocks=kv.num_free_blocks,
            num_blocks=kv.num_blocks,
            num_preemptions=sched.num_preemptions,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
        )
        if spec is not None:
            snap.spec_num_drafts = spec.num_drafts
            snap.spec_num_draft_tokens = spec.num_draft_tokens
            snap.spec_num_accepted_tokens = spec.num_accepted_tokens
            snap.spec_accepted_per_pos = tuple(spec.accepted_per_pos)
        return snap

    def _call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        # The loop may close between the check and the call.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(fn, *args)
