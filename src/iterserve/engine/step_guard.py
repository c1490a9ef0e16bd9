"""The executor as the async engine runs it: the step in flight is remembered (so a
failure is pinned on its requests), a test-only fault hook, an optional step timeout."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any

from iterserve.core.outputs import SchedulerOutput


class StepTimeoutError(RuntimeError):
    """A model step ran past the step timeout."""


class GuardedExecutor:
    """Wraps the executor: remembers the step being run (so a failure can be pinned on
    its requests), runs a test-only fault hook, and optionally enforces a step timeout.

    With no timeout the step runs inline on the engine thread (no hand-off cost). With a
    timeout it runs on a worker thread; a step past the deadline is abandoned (a thread
    cannot be killed) and a fresh worker serves the next step. The fault hook runs on
    that worker before the forward pass and an abandoned step skips its forward, so an
    injected hang never races the next step. A genuinely hung forward pass keeps its
    worker; only the injected kind is safe to abandon.
    """

    def __init__(self, inner: Any, step_timeout_s: float | None = None) -> None:
        self.inner = inner
        self.step_timeout_s = step_timeout_s
        self.fault_hook: Callable[[SchedulerOutput], None] | None = None
        self.current: SchedulerOutput | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._abandoned: set[int] = set()

    def execute(self, scheduler_output: SchedulerOutput) -> Any:
        self.current = scheduler_output
        if self.step_timeout_s is None:
            if self.fault_hook is not None:
                self.fault_hook(scheduler_output)
            return self.inner.execute(scheduler_output)
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="iterserve-step"
            )
        fut = self._pool.submit(self._run, scheduler_output)
        try:
            return fut.result(timeout=self.step_timeout_s)
        except concurrent.futures.TimeoutError:
            self._abandoned.add(scheduler_output.step_id)
            self._pool.shutdown(wait=False)
            self._pool = None
            raise StepTimeoutError(
                f"step {scheduler_output.step_id} exceeded the step timeout "
                f"({self.step_timeout_s:.3g} s)"
            ) from None

    def _run(self, scheduler_output: SchedulerOutput) -> Any:
        if self.fault_hook is not None:
            self.fault_hook(scheduler_output)
        if scheduler_output.step_id in self._abandoned:
            raise StepTimeoutError("abandoned")
        return self.inner.execute(scheduler_output)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
