"""AsyncLLM: the engine on a background thread, one async output stream per request.

Threads and who owns what:

- The **engine thread** (``engine.core_thread``) owns the ``EngineCore``. Requests,
  aborts and stop-string finishes reach it as typed messages through its inbox,
  drained between steps; each step's outputs come back with one
  ``loop.call_soon_threadsafe``, so the loop never waits on a forward pass.
- The **event loop** (the HTTP server's) owns the ``OutputProcessor`` (fan-out,
  detokenization, stop strings, timings; as vLLM V1's, it overlaps the next forward
  pass) and every request's stream. A stop string ends the stream at once; the engine
  learns of it through the inbox and frees the request before its next step.
- A small **tokenizer pool** runs tokenization and chat templates, so they neither
  block the loop nor queue behind the model step.

With ``from_engine_config(..., engine_core_process=True)`` (``serve --engine-core-process``)
the engine core runs in a process of its own instead of the engine thread
(``engine.core_proc``, driven by ``engine.core_proc_client.EngineCoreProcClient``, which
takes the thread's place here); everything on the event loop stays as described.

Failure model (each accepted request ends exactly once: stop, length, abort or error):

- a step that raises finishes the requests of that step with ``error``; the engine
  goes on serving the rest;
- an exception anywhere else in the engine loop kills it: ``is_healthy`` turns
  False, every pending stream raises ``EngineDeadError``, new requests are refused.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from iterserve.core.outputs import EngineCoreOutputs, SchedulerOutput
from iterserve.core.sampling_params import SamplingParams
from iterserve.core.slo import AdmissionRefused
from iterserve.engine.client_base import TokenizerClient
from iterserve.engine.core_thread import (
    AbortRequests,
    AddRequests,
    EngineCoreThread,
    FinishRequests,
    Shutdown,
)
from iterserve.engine.exceptions import (  # re-exported: they were defined here
    EngineDeadError,
    EngineStepError,
    RequestRefusedError,
    RequestRejectedError,
)
from iterserve.engine.output_processor import CompletionDelta, OutputProcessor, RequestState
from iterserve.engine.step_guard import StepGuard, make_fault_hook
from iterserve.metrics import Metrics

logger = logging.getLogger("iterserve.async_llm")

__all__ = [
    "AsyncLLM",
    "CompletionDelta",
    "EngineDeadError",
    "EngineStepError",
    "RequestRejectedError",
]

_END = object()  # a stream's last item: every child has finished


def _off_this_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` on a thread of its own that ends with it.

    Loading a model runs torch's parallel kernels (the kernel timing, the warm-up), and
    OpenMP keeps a team of worker threads for every thread that ever ran one. With two
    teams (the loop thread's and the engine thread's) on a machine with few cores,
    libgomp stops spinning its workers between parallel regions, and every region pays
    a wake-up: measured on 2 cores, a 256-token prefill 84 ms against 50 ms with the
    engine thread's team alone. A team goes with its thread, so the load runs on a
    throwaway thread and the engine thread is the only one with a team.
    """
    result: list[Any] = []

    def run() -> None:
        try:
            result.append((True, fn(*args, **kwargs)))
        except BaseException as e:  # re-raised on the calling thread
            result.append((False, e))

    # Daemon: Ctrl-C during a long load ends the process rather than waiting on it.
    thread = threading.Thread(target=run, name="iterserve-load", daemon=True)
    thread.start()
    thread.join()
    ok, value = result[0]
    if not ok:
        raise value
    return value


class AsyncLLM(TokenizerClient):
    """An ``EngineCore`` driven by a background thread, with async per-request streams.

    Call ``start()`` from inside the serving event loop and ``shutdown()`` before
    the loop closes. ``engine_core`` should have a ``StepGuard`` (``from_engine_config``
    gives it one) for the step timeout and the test-only fault hooks.
    """

    def __init__(
        self,
        engine_core: Any,
        tokenizer: Any,
        *,
        model_name: str = "iterserve",
        max_model_len: int,
        eos_token_ids: list[int] | None = None,
        long_rope_after: int | None = None,
        metrics: Metrics | None = None,
        log_stats_interval_s: float = 10.0,
        num_tokenizer_threads: int = 2,
        vocab_size: int | None = None,
        sampling_defaults: dict[str, Any] | None = None,
        stream_interval: int = 1,
        core_client: Any = None,
    ) -> None:
        # ``core_client``: an ``EngineCoreProcClient`` when the engine core runs in a
        # process of its own (``engine_core`` is then its ``RemoteEngineCore``).
        self.engine_core = engine_core
        self._init_tokenizer_client(tokenizer, num_tokenizer_threads)
        self.model_name = model_name
        self.max_model_len = max_model_len
        # Token ids a prompt may hold: the model's embedding rows.
        self.vocab_size = vocab_size if vocab_size is not None else len(tokenizer)
        self.output_processor = OutputProcessor(
            tokenizer, eos_token_ids or (), stream_interval=stream_interval,
            long_rope_after=long_rope_after,
        )
        self.eos_token_id: int | None = self.output_processor.eos_token_id
        self.metrics = metrics or Metrics(model_name)
        cache_config = (core_client.cache_config if core_client is not None else
                        getattr(getattr(engine_core, "scheduler", None), "cache_config", None))
        self.metrics.attach_engine(max_model_len, cache_config)
        # Defaults for what a request leaves out (the model's generation_config.json).
        self.sampling_defaults: dict[str, Any] = dict(sampling_defaults or {})
        self.log_stats_interval_s = log_stats_interval_s

        self.core_client = core_client
        self._core_thread: Any
        if core_client is None:
            self._core_thread = EngineCoreThread(
                engine_core,
                self.metrics,
                on_outputs=self._on_outputs,
                on_rejected=self._on_rejected,
                on_dead=self._fail_all,
            )
        else:
            core_client.bind(self.metrics, self.output_processor, on_outputs=self._on_outputs,
                             on_rejected=self._on_rejected, on_dead=self._fail_all)
            self._core_thread = core_client
        # Parent request id -> the queue its ``generate()`` reads (loop-owned).
        self._streams: dict[str, asyncio.Queue] = {}
        self._log_task: asyncio.Task | None = None
        self._is_shutting_down = False
        self._started = False
        # Test-only audit trail (enable_finish_log): (parent id, child index, finish reason)
        # for every child that ends, so a soak can prove each ended exactly once.
        self.finish_log: collections.deque | None = None
        # Opt-in per-request records on the engine's clock (``serve --request-log``):
        # anything with ``write(request_id, finish_reason, RequestMetrics)``.
        self.request_log: Any = None

    # -- construction ---------------------------------------------------------------

    @classmethod
    def from_engine_config(
        cls, engine_config: Any, *, step_timeout_s: float | None = None,
        engine_core_process: bool = False, **kwargs: Any
    ) -> AsyncLLM:
        """Load the model (``engine.builder.build_engine``, its steps guarded by a
        ``StepGuard`` with ``step_timeout_s``) and wrap it. ``engine_core_process``: the
        engine core runs in a process of its own (``engine.core_proc``); this process
        keeps the tokenizer, detokenization and streaming."""
        from iterserve.engine.builder import build_engine
        from iterserve.model.generation_config import sampling_defaults

        if engine_core_process:
            from iterserve.engine.core_proc_client import async_llm_over_process

            return async_llm_over_process(cls, engine_config, step_timeout_s, **kwargs)

        engine_core, tokenizer, model_config = _off_this_thread(
            build_engine, engine_config, step_guard=StepGuard(step_timeout_s)
        )
        # The resolved context length (the model's when the config leaves it unset).
        kwargs.setdefault("max_model_len", engine_core.scheduler.max_model_len)
        kwargs.setdefault("eos_token_ids", list(getattr(model_config, "eos_token_ids", []) or []))
        kwargs.setdefault("vocab_size", model_config.vocab_size)
        kwargs.setdefault("long_rope_after", getattr(model_config, "long_rope_after", None))
        kwargs.setdefault("stream_interval", engine_config.scheduler.stream_interval)
        kwargs.setdefault("sampling_defaults", sampling_defaults(
            model_config.model_path, engine_config.generation_config
        ))
        return cls(engine_core, tokenizer, **kwargs)

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        # The engine thread and the event loop share the GIL: with the default 5 ms switch
        # interval the engine waited up to 5 ms to get it back after a torch op whenever
        # the loop was busy streaming (measured: TPOT a third lower at low load).
        if self.core_client is None:  # (the engine's own process has its own GIL)
            sys.setswitchinterval(min(sys.getswitchinterval(), 0.0002))
        loop = asyncio.get_running_loop()
        self._core_thread.start(loop)
        self._started = True
        self.metrics.engine_healthy.set(1)
        if self.log_stats_interval_s > 0:
            self._log_task = loop.create_task(self._log_stats_forever())

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Stop taking requests, let in-flight ones finish for up to ``drain_timeout_s``,
        abort the rest, then stop the engine thread."""
        self._is_shutting_down = True
        deadline = time.monotonic() + drain_timeout_s
        while self._streams and time.monotonic() < deadline and self.is_healthy:
            await asyncio.sleep(0.05)
        for request_id in list(self._streams):
            self.abort(request_id)
        self._core_thread.send(Shutdown())
        if self._started or self.core_client is not None:
            await asyncio.to_thread(self._core_thread.join, 10.0)
        if self.core_client is not None:
            await self.core_client.aclose()
        if self._log_task is not None:
            self._log_task.cancel()
        self._shutdown_tokenizer_pools()
        structured = getattr(self.engine_core, "structured_outputs", None)
        if structured is not None:
            structured.shutdown()  # its grammar pool
        self.metrics.engine_healthy.set(0)

    @property
    def is_healthy(self) -> bool:
        return self._core_thread.is_alive

    @property
    def dead_error(self) -> BaseException | None:
        return self._core_thread.dead_error

    def check_health(self) -> None:
        if self._is_shutting_down:
            raise EngineDeadError("the server is shutting down")
        if not self.is_healthy:
            raise EngineDeadError(f"the engine loop is not running: {self.dead_error!r}")

    @property
    def num_unfinished_requests(self) -> int:
        """Engine requests (children) accepted and not yet finished."""
        return self.output_processor.num_unfinished_requests

    def _step_guard(self) -> StepGuard:
        guard = self.engine_core.step_guard
        if guard is None:
            raise RuntimeError(
                "the engine core has no step guard: build it with "
                "EngineCore(..., step_guard=StepGuard()) or AsyncLLM.from_engine_config"
            )
        return guard

    def set_fault(self, kind: str, count: int = 1, seconds: float = 5.0) -> None:
        """Test-only: the next ``count`` steps raise, hang ``seconds`` or kill the engine
        loop (``step_guard.make_fault_hook``); ``none`` clears the hook."""
        if self.core_client is not None:
            self.core_client.set_fault(kind, count, seconds)
            return
        self.set_fault_hook(None if kind == "none" else make_fault_hook(kind, count, seconds))

    def kv_state(self) -> dict[str, int]:
        """The KV blocks free and in all, and the idle-leak reports (test hooks): live
        in one process, as of the latest step from an engine core process."""
        if self.core_client is not None:
            return self.core_client.kv_state()
        kv = self.engine_core.scheduler.kv
        return {"num_free_blocks": kv.num_free_blocks, "num_blocks": kv.num_blocks,
                "num_leak_reports": self.engine_core.num_leak_reports}

    def set_fault_hook(self, hook: Callable[[SchedulerOutput], None] | None) -> None:
        """Test-only: ``hook(scheduler_output)`` runs before every forward pass, on the
        thread that runs it; it may raise (a failing step) or sleep (a hung step)."""
        self._step_guard().fault_hook = hook

    def enable_finish_log(self, maxlen: int = 1_000_000) -> None:
        """Test-only: record every child's end in ``finish_log`` (bounded)."""
        if self.finish_log is None:
            self.finish_log = collections.deque(maxlen=maxlen)

    def set_step_timeout(self, step_timeout_s: float | None) -> None:
        if self.core_client is not None:
            self.core_client.set_step_timeout(step_timeout_s)
            return
        self._step_guard().step_timeout_s = step_timeout_s

    # -- requests -------------------------------------------------------------------

    async def generate(
        self,
        prompts: list[list[int]],
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        tenant: str = "default",
        cache_salt: str | None = None,
        session_key: str | None = None,  # a router's affinity hint: one engine needs none
        prepare: Callable[[list[Any]], None] | None = None,
    ) -> AsyncIterator[CompletionDelta]:
        """Stream the deltas of ``len(prompts) * sampling_params.n`` child requests.

        Child ``i * n + j`` samples prompt ``i`` for the ``j``-th time (seed + j when a
        seed is set, as vLLM does). Leaving the iterator early aborts what is unfinished.
        Raises ``EngineDeadError`` when the engine is (or dies) unavailable,
        ``EngineStepError`` for a child whose step failed, ``RequestRejectedError`` when
        the scheduler refuses a child. ``prepare``: see ``add_request``.
        """
        stream = self.add_request(
            prompts, sampling_params, request_id, priority=priority, tenant=tenant,
            cache_salt=cache_salt, prepare=prepare,
        )
        try:
            while True:
                item = await stream.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if request_id in self._streams:
                self.abort(request_id)

    def add_request(
        self,
        prompts: list[list[int]],
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        tenant: str = "default",
        cache_salt: str | None = None,
        prepare: Callable[[list[Any]], None] | None = None,
    ) -> asyncio.Queue:
        """Start ``request_id``; returns the queue its deltas (then an end marker) go to.
        ``prepare(requests)`` may adjust the child engine requests (and their output
        processor states) before the engine sees them: a decode engine continuing from
        transferred KV (engine/kv_transfer.py)."""
        self.check_health()
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        requests = self.output_processor.add_request(
            request_id, prompts, sampling_params, time.monotonic(),
            priority=priority, tenant=tenant, cache_salt=cache_salt,
        )
        stream: asyncio.Queue = asyncio.Queue()
        if not requests:
            stream.put_nowait(_END)
            return stream
        if prepare is not None:
            prepare(requests)
        self._streams[request_id] = stream
        self._core_thread.send(AddRequests(requests))
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a parent request: its unfinished children end with ``abort`` now, and
        the engine frees their blocks before its next step. Idempotent."""
        if request_id not in self._streams:
            return
        ended = self.output_processor.abort_request(request_id, time.monotonic())
        self._deliver(ended)
        if ended:
            self._core_thread.send(AbortRequests([state.request_id for state, _ in ended]))

    # -- on the event loop: the engine thread's callbacks -------------------------------

    def _on_outputs(self, outputs: EngineCoreOutputs, now: float) -> None:
        processed = self.output_processor.process_outputs(outputs, now)
        metrics = self.metrics
        stats = processed.stats
        for arrival, prev in stats.token_outputs:
            metrics.observe_new_tokens(arrival, prev, now)
        self._deliver(processed.deltas)
        metrics.observe_tokens(stats.num_prompt_tokens, stats.num_generation_tokens)
        metrics.observe_admitted(stats.num_cached_tokens)
        if processed.reqs_to_finish:
            self._core_thread.send(FinishRequests(processed.reqs_to_finish))

    def _deliver(self, deltas: list[tuple[RequestState, CompletionDelta]]) -> None:
        """Put each delta on its stream (a step failure as ``EngineStepError``), then end
        the streams whose children have all finished."""
        for state, delta in deltas:
            stream = self._streams.get(state.parent.request_id)
            if stream is not None:
                if delta.finish_reason == "error":
                    stream.put_nowait(EngineStepError(str(delta.stop_reason or "step failed")))
                else:
                    stream.put_nowait(delta)
        self._finished(deltas)

    def _finished(self, ended: list[tuple[RequestState, CompletionDelta]]) -> None:
        """Account for the children the output processor has finished (those of
        ``ended`` with a finish reason) and end their parents' streams when done."""
        metrics = self.metrics
        done: set[str] = set()  # parents ended by this batch (a parent ends in one batch)
        for state, _ in ended:
            if state.finish_reason is None:
                continue
            m = state.metrics()
            metrics.observe_finished(
                state.finish_reason, m, state.request.sampling_params.max_tokens
            )
            if self.request_log is not None:
                self.request_log.write(state.request_id, state.finish_reason, m)
            parent = state.parent
            n = max(parent.n, 1)
            per_prompt = parent.max_output_tokens
            if not per_prompt:
                per_prompt.extend([0] * (len(parent.child_ids) // n))
            k = state.index // n
            per_prompt[k] = max(per_prompt[k], state.num_output_tokens)
            if self.finish_log is not None:
                self.finish_log.append((parent.request_id, state.index, state.finish_reason))
            if parent.is_finished and parent.request_id not in done:
                done.add(parent.request_id)
                metrics.observe_parent(parent.n, per_prompt)
                stream = self._streams.pop(parent.request_id, None)
                if stream is not None:
                    stream.put_nowait(_END)

    def _on_rejected(self, rejected: dict[str, ValueError]) -> None:
        now = time.monotonic()
        processor = self.output_processor
        for cid, exc in rejected.items():
            state = processor.request_states.get(cid)
            if state is None:
                continue
            parent_id = state.parent.request_id
            stream = self._streams.get(parent_id)
            # The whole parent fails: its siblings are aborted so nothing is left behind.
            if stream is not None:
                refused = isinstance(exc, AdmissionRefused)  # an SLO it cannot meet: a 429
                err = RequestRefusedError if refused else RequestRejectedError
                stream.put_nowait(err(str(exc)))
            self._finished(processor.finish_requests([cid], "error", now))
            siblings = processor.abort_request(parent_id, now)
            self._finished(siblings)
            if siblings:
                self._core_thread.send(AbortRequests([s.request_id for s, _ in siblings]))

    def _fail_all(self, exc: BaseException) -> None:
        err = EngineDeadError(f"the engine loop died: {type(exc).__name__}: {exc}")
        now = time.monotonic()
        processor = self.output_processor
        for parent_id, stream in list(self._streams.items()):
            stream.put_nowait(err)
            ids = processor.unfinished_child_ids(parent_id)
            self._finished(processor.finish_requests(ids, "error", now))

    async def _log_stats_forever(self) -> None:
        while True:
            await asyncio.sleep(self.log_stats_interval_s)
            line = self.metrics.log_line()
            if line:
                logger.info(line)
