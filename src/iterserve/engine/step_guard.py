"""The step guard: how EngineCore runs a model step when it must survive a bad one
(the server's engine): a test-only fault hook and an optional step timeout."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from typing import Any

from iterserve.core.outputs import SchedulerOutput


class StepTimeoutError(RuntimeError):
    """A model step ran past the step timeout."""


class EngineKilled(BaseException):
    """Test-only: escapes the step's error handling and kills the engine loop."""


FAULT_KINDS = ("raise", "hang", "kill", "none")


def make_fault_hook(kind: str, count: int = 1,
                    seconds: float = 5.0) -> Callable[[SchedulerOutput], None]:
    """Test-only (``--enable-test-hooks``): a fault hook whose next ``count`` calls raise
    (``raise``: a failing step), sleep ``seconds`` (``hang``) or kill the engine loop
    (``kill``). Built where the engine runs: in its thread, or in its process."""
    if kind not in FAULT_KINDS:
        raise ValueError(f"kind must be one of {', '.join(FAULT_KINDS)}, got {kind!r:.40}")
    remaining = [count]

    def hook(_: SchedulerOutput) -> None:
        if remaining[0] <= 0:
            return
        remaining[0] -= 1
        if kind == "raise":
            raise RuntimeError("injected step failure")
        if kind == "hang":
            time.sleep(seconds)
        if kind == "kill":
            raise EngineKilled("injected engine death")

    return hook


class StepGuard:
    """Runs ``executor.execute`` for EngineCore, which is given the guard at construction
    (``EngineCore(..., step_guard=StepGuard(timeout))``).

    With no timeout the step runs inline on the engine thread (no hand-off cost). With a
    timeout it runs on a worker thread; a step past the deadline is abandoned (a thread
    cannot be killed) and a fresh worker serves the next step. The fault hook runs on
    that worker before the forward pass and an abandoned step skips its forward, so an
    injected hang never races the next step. A genuinely hung forward pass keeps its
    worker; only the injected kind is safe to abandon.
    """

    def __init__(self, step_timeout_s: float | None = None) -> None:
        self.step_timeout_s = step_timeout_s
        # Test-only: runs before every forward pass; may raise (a failing step) or
        # sleep (a hung step).
        self.fault_hook: Callable[[SchedulerOutput], None] | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._abandoned: set[int] = set()

    def execute(self, executor: Any, scheduler_output: SchedulerOutput) -> Any:
        if self.step_timeout_s is None:
            if self.fault_hook is not None:
                self.fault_hook(scheduler_output)
            return executor.execute(scheduler_output)
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="iterserve-step"
            )
        fut = self._pool.submit(self._run, executor, scheduler_output)
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

    def _run(self, executor: Any, scheduler_output: SchedulerOutput) -> Any:
        if self.fault_hook is not None:
            self.fault_hook(scheduler_output)
        if scheduler_output.step_id in self._abandoned:
            raise StepTimeoutError("abandoned")
        return executor.execute(scheduler_output)
