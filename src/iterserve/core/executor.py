"""The executor seam: what EngineCore needs from whatever runs a step.

Two implementations: ``model.runner.ModelRunner`` (a real PyTorch forward pass)
and ``sim.executor.SimulatedExecutor`` (a cost model on a virtual clock).
"""

from __future__ import annotations

from typing import Protocol

from iterserve.core.outputs import ModelRunnerOutput, SchedulerOutput


class Executor(Protocol):
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Perform the swaps, run the forward pass, sample; one token per finished prefill."""
        ...
