"""EngineCore: one step = schedule -> execute -> update.

The same EngineCore serves traffic (with the PyTorch ModelRunner) and simulates it
(with the SimulatedExecutor and a virtual clock): only the executor and the clock
differ. It deals in token ids only: text, stop strings, n-sample fan-out and
per-request timing belong to the output processor (``engine.output_processor``) on
the caller's side, which reports a stop string back through ``finish_requests``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from iterserve.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from iterserve.core.executor import Executor
from iterserve.core.kv_groups import KVCacheGroupSpec
from iterserve.core.outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    ModelRunnerOutput,
    SchedulerOutput,
)
from iterserve.core.request import Request, RequestStatus
from iterserve.core.scheduler import Scheduler
from iterserve.engine.step_guard import StepGuard
from iterserve.spec_decode import DraftRequest, Proposer, make_proposer

logger = logging.getLogger(__name__)


def make_scheduler(
    scheduler_config: SchedulerConfig,
    cache_config: CacheConfig,
    speculative_config: SpeculativeConfig | None = None,
    kv_cache_groups: Sequence[KVCacheGroupSpec] | None = None,
) -> Scheduler:
    """The continuous scheduler, or a request-level baseline (static / dynamic).
    ``kv_cache_groups``: the model's (core/kv_groups.py), None for one global group."""
    if scheduler_config.scheduler == "continuous":
        return Scheduler(scheduler_config, cache_config, speculative_config, kv_cache_groups)
    if kv_cache_groups is not None and len(kv_cache_groups) > 1:
        raise ValueError(
            "scheduler: a model with sliding-window KV cache groups needs the continuous "
            f"scheduler, not {scheduler_config.scheduler!r}")
    if speculative_config is not None:
        raise ValueError(
            "speculative_config: speculative decoding needs the continuous scheduler, not "
            f"scheduler={scheduler_config.scheduler!r}")
    from iterserve.core.baselines import make_baseline_scheduler

    return make_baseline_scheduler(scheduler_config, cache_config)


class EngineCore:
    """``step_guard``: run each model step through it (the server's engine: a step
    timeout, test-only fault injection); without one the executor is called directly.

    ``speculative_config``: speculative decoding; ``proposer`` guesses the drafts
    (default: ``make_proposer`` for the config's method), asked after every step for
    the requests the scheduler's adaptive rule wants drafts for."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        executor: Executor,
        *,
        clock: Callable[[], float] = time.monotonic,
        step_guard: StepGuard | None = None,
        structured_outputs: Any = None,
        speculative_config: SpeculativeConfig | None = None,
        proposer: Proposer | None = None,
    ) -> None:
        # The model's KV cache groups (sliding-window layers), when the executor has them.
        groups = getattr(executor, "kv_cache_groups", None)
        self.scheduler = make_scheduler(scheduler_config, cache_config, speculative_config,
                                        groups)
        if speculative_config is not None and proposer is None:
            proposer = make_proposer(
                speculative_config, max_model_len=scheduler_config.max_model_len)
        self.proposer = proposer if speculative_config is not None else None
        spec = self.scheduler.spec
        if spec is not None:
            # The fused few-row decoder's row cap: past it a step costs a cliff more.
            layout = getattr(executor, "step_layout", None)
            spec.set_fused_rows(int(getattr(layout, "decoder_rows", 0) or 0))
        self.num_proposer_errors = 0
        # engine.structured_output.StructuredOutputManager, or None (no grammar support,
        # e.g. in the simulator).
        self.structured_outputs = structured_outputs
        self.executor = executor
        self.step_guard = step_guard
        self.clock = clock
        self.num_steps = 0
        self.num_failed_steps = 0
        self.num_leak_reports = 0
        # The current (or last) step's SchedulerOutput, for failure attribution,
        # tracing and tests; None while a step has not got past schedule().
        self.last_scheduler_output: SchedulerOutput | None = None

    # -- requests ---------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; raises ValueError (naming the problem) if it can never run."""
        so_params = request.sampling_params.structured_outputs
        if so_params is not None:
            if self.structured_outputs is None:
                raise ValueError("structured_outputs: not supported by this engine")
            self.structured_outputs.add_request(request.request_id, so_params)
        try:
            self.scheduler.add_request(request)
        except BaseException:
            if so_params is not None:
                self.structured_outputs.drop([request.request_id])
            raise

    def abort_requests(self, request_ids: list[str] | str) -> list[EngineCoreOutput]:
        """Abort unknown or finished ids as a no-op; returns the final outputs."""
        return self.scheduler.abort_requests(request_ids, self.clock())

    def finish_requests(
        self, request_ids: list[str], status: RequestStatus
    ) -> list[EngineCoreOutput]:
        """Finish requests from outside a step (e.g. a stop string matched by the
        output processor); unknown or finished ids are ignored."""
        return self.scheduler.finish_requests(request_ids, status, self.clock())

    def fail_requests(self, request_ids: list[str], error: str) -> list[EngineCoreOutput]:
        """Finish requests with ``error`` from outside a step (e.g. a step watchdog)."""
        outputs = self.scheduler.finish_requests(
            request_ids, RequestStatus.FINISHED_ERROR, self.clock()
        )
        for o in outputs:
            o.stop_reason = error
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> EngineCoreOutputs:
        """One step; its outputs (empty when nothing ran) iterate as ``EngineCoreOutput``
        objects, one per request that got a token or finished."""
        scheduler = self.scheduler
        self.last_scheduler_output = None
        t_start = self.clock()
        sched_out = scheduler.schedule(t_start)
        self.last_scheduler_output = sched_out
        if sched_out.is_empty:
            # Nothing to run: keep the finished ids for the next real step's executor.
            scheduler.finished_req_ids[:0] = sched_out.finished_req_ids
            return EngineCoreOutputs()
        self.num_steps += 1
        structured = self.structured_outputs
        if structured is not None and structured.matchers:
            structured.drop(sched_out.finished_req_ids)
            sched_out.grammar_bitmask = structured.bitmask(sched_out)
        try:
            guard = self.step_guard
            if guard is None:
                runner_out = self.executor.execute(sched_out)
            else:
                runner_out = guard.execute(self.executor, sched_out)
        except Exception as e:  # a failing step must not take the engine down
            self.num_failed_steps += 1
            logger.exception("model step %d failed", sched_out.step_id)
            return self._fail_step(sched_out, f"{type(e).__name__}: {e}")
        outputs = scheduler.update(sched_out, runner_out, self.clock())
        if structured is not None and structured.matchers:
            self._finish_stopped(outputs, structured.advance(outputs))
        if self.proposer is not None:
            self._propose(sched_out, t_start)
        if not scheduler.requests:
            self._check_idle_cache()
        return outputs

    def _propose(self, sched_out: SchedulerOutput, t_start: float) -> None:
        """Drafts for the next step: the scheduler says who and how many (its adaptive
        K), the proposer guesses. A failing proposer costs speculation, never the step.
        The step's seconds so far and the proposer's go to the adaptive rule."""
        proposer = self.proposer
        spec = self.scheduler.spec
        assert proposer is not None and spec is not None
        so = sched_out
        t_prop = self.clock()
        spec.observe_cost(so.num_prefill_tokens, so.num_decode_tokens + so.num_spec_tokens,
                          t_prop - t_start)
        try:
            for req in spec.pop_finished():
                proposer.on_request_finished(
                    req.request_id, req.all_token_ids, req.num_prompt_tokens)
            plan = spec.plan(self.scheduler.running, self.scheduler.pending_prefill_tokens)
            if not plan:
                return
            t0 = self.clock()
            drafts = proposer.propose_batch(
                [DraftRequest(r.request_id, r.all_token_ids, r.num_prompt_tokens, k)
                 for r, k in plan])
            spec.observe_draft_cost(len(plan), self.clock() - t0)
        except Exception:
            self.num_proposer_errors += 1
            logger.exception("speculative proposer failed; this step verifies no drafts")
            return
        for (req, k), d in zip(plan, drafts):
            spec.observe_proposal(req.request_id, bool(d))
            if d:
                req.spec_token_ids = [int(t) for t in d[:k]]

    def _finish_stopped(self, outputs: EngineCoreOutputs, request_ids: list[str]) -> None:
        """End requests that sampled a token this step and are done by a rule outside the
        scheduler (a complete grammar): finish ``stop``, their outputs final."""
        if not request_ids:
            return
        lps = outputs.logprobs
        for rid in request_ids:
            o = outputs.finished.get(rid)
            if o is None:
                lp = [lps[rid]] if lps and rid in lps else None
                o = EngineCoreOutput(rid, [outputs.sampled[rid]], lp)
                outputs.add_final(o)
            o.finish_reason = "stop"
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED, self.clock())

    def _check_idle_cache(self) -> None:
        """Invariant 6, checked in production whenever the engine goes idle: every block
        is free (cached blocks count as free). Cheap insurance against a KV leak."""
        kv = self.scheduler.kv
        if kv.num_free_blocks != kv.num_blocks:
            self.num_leak_reports += 1
            logger.error(
                "KV cache leak: engine idle but %d of %d blocks are held",
                kv.num_blocks - kv.num_free_blocks,
                kv.num_blocks,
            )

    def _fail_step(self, sched_out: SchedulerOutput, error: str) -> EngineCoreOutputs:
        ids = [r.request_id for r in sched_out.scheduled_requests]
        outputs = EngineCoreOutputs()
        for o in self.fail_requests(ids, error):
            outputs.add_final(o)
        return outputs

    def run_until_idle(self) -> list[EngineCoreOutput]:
        """Step until every request has finished (tests and offline use)."""
        outputs: list[EngineCoreOutput] = []
        while self.has_unfinished_requests():
            outputs.extend(self.step())
        return outputs


__all__ = ["EngineCore", "ModelRunnerOutput", "StepGuard", "make_scheduler"]
