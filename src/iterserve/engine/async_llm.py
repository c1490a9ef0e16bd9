"""AsyncLLM: the engine loop on a background thread, one async output stream per request.

Threads and who owns what:

- The **engine thread** owns the ``EngineCore`` (scheduler, executor, detokenizer).
  Nothing else touches it. Adds and aborts reach it through ``_inbox``, drained
  between steps, so a step never sees the request set change under it.
- The **event loop** (the HTTP server's) owns every ``_Stream`` and ``_Child``.
  The engine thread hands each step's outputs over with one
  ``loop.call_soon_threadsafe`` per step; the loop never waits on a forward pass.
- A small **tokenizer pool** runs tokenization and chat templates, so they neither
  block the loop nor queue behind the model step.
- **Detokenization** (incremental, with stop strings) runs on the loop as outputs
  arrive, as vLLM V1's output processor does, overlapping the next forward pass. A stop
  string ends the stream at once; the engine learns of it through the inbox and frees
  the request before its next step (any token computed meanwhile is dropped).

Failure model (each accepted request ends exactly once: stop, length, abort or error):

- a step that raises finishes the requests of that step with ``error``; the engine
  goes on serving the rest;
- an exception anywhere else in the engine loop kills it: ``is_healthy`` turns
  False, every pending stream raises ``EngineDeadError``, new requests are refused.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from iterserve.core.outputs import EngineCoreOutput, SchedulerOutput, TokenLogprobs
from iterserve.core.request import Request, RequestStatus
from iterserve.core.sampling_params import SamplingParams
from iterserve.engine.chat_template import render_chat
from iterserve.engine.detokenizer import IncrementalDetokenizer
from iterserve.engine.exceptions import (  # re-exported: they were defined here
    EngineDeadError,
    EngineStepError,
    RequestRejectedError,
)
from iterserve.engine.step_guard import GuardedExecutor
from iterserve.metrics import Metrics, SchedulerSnapshot

logger = logging.getLogger("iterserve.async_llm")

__all__ = [
    "AsyncLLM",
    "CompletionDelta",
    "EngineDeadError",
    "EngineStepError",
    "RequestRejectedError",
]

@dataclass(slots=True)
class CompletionDelta:
    """What one child request produced since its previous delta."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0


@dataclass(slots=True)
class _Child:
    """One engine request: a (prompt, sample) pair of a parent request."""

    index: int
    request: Request
    stream: _Stream
    detokenizer: IncrementalDetokenizer | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_output_tokens: int = 0


@dataclass(slots=True)
class _Stream:
    """The loop-side state of one parent request (n x prompts children)."""

    request_id: str
    queue: asyncio.Queue
    child_ids: list[str] = field(default_factory=list)
    num_unfinished: int = 0


_END = object()  # a stream's last item: every child has finished


class AsyncLLM:
    """An ``EngineCore`` driven by a background thread, with async per-request streams.

    Call ``start()`` from inside the serving event loop and ``shutdown()`` before
    the loop closes.
    """

    def __init__(
        self,
        engine_core: Any,
        tokenizer: Any,
        *,
        model_name: str = "iterserve",
        max_model_len: int,
        eos_token_ids: list[int] | None = None,
        metrics: Metrics | None = None,
        step_timeout_s: float | None = None,
        log_stats_interval_s: float = 10.0,
        num_tokenizer_threads: int = 2,
        vocab_size: int | None = None,
        sampling_defaults: dict[str, Any] | None = None,
    ) -> None:
        self.engine_core = engine_core
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        # Token ids a prompt may hold: the model's embedding rows.
        self.vocab_size = vocab_size if vocab_size is not None else len(tokenizer)
        # As the offline LLM: the tokenizer's EOS ends a request (finish "stop", no
        # stop_reason); the model's other end tokens (Llama 3) act as stop token ids.
        ids = list(eos_token_ids or [])
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_token_id: int | None = eos if eos is not None else (ids[0] if ids else None)
        self._extra_eos = [t for t in ids if t != self.eos_token_id]
        self.metrics = metrics or Metrics(model_name)
        # Defaults for what a request leaves out (the model's generation_config.json).
        self.sampling_defaults: dict[str, Any] = dict(sampling_defaults or {})
        self.log_stats_interval_s = log_stats_interval_s

        self._executor = GuardedExecutor(engine_core.executor, step_timeout_s)
        engine_core.executor = self._executor
        # Detokenize here (on the loop), not in EngineCore's step on the engine thread.
        engine_core.tokenizer = None

        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._children: dict[str, _Child] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._log_task: asyncio.Task | None = None
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(
            num_tokenizer_threads, thread_name_prefix="iterserve-tok"
        )
        self._token_str_cache: dict[int, str] = {}
        self._dead_error: BaseException | None = None
        self._is_shutting_down = False
        # Test-only audit trail (enable_finish_log): (parent id, child index, finish reason)
        # for every child that ends, so a soak can prove each ended exactly once.
        self.finish_log: collections.deque | None = None

    # -- construction ---------------------------------------------------------------

    @classmethod
    def from_engine_config(cls, engine_config: Any, **kwargs: Any) -> AsyncLLM:
        """Load the model (``engine.builder.build_engine``) and wrap it."""
        from iterserve.engine.builder import build_engine
        from iterserve.model.generation_config import sampling_defaults

        engine_core, tokenizer, model_config = build_engine(engine_config)
        kwargs.setdefault("max_model_len", engine_config.scheduler.max_model_len)
        kwargs.setdefault("eos_token_ids", list(getattr(model_config, "eos_token_ids", []) or []))
        kwargs.setdefault("vocab_size", model_config.vocab_size)
        kwargs.setdefault("sampling_defaults", sampling_defaults(
            model_config.model_path, engine_config.generation_config
        ))
        return cls(engine_core, tokenizer, **kwargs)

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(
            target=self._engine_loop, name="iterserve-engine", daemon=True
        )
        self._thread.start()
        self.metrics.engine_healthy.set(1)
        if self.log_stats_interval_s > 0:
            self._log_task = self._loop.create_task(self._log_stats_forever())

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Stop taking requests, let in-flight ones finish for up to ``drain_timeout_s``,
        abort the rest, then stop the engine thread."""
        self._is_shutting_down = True
        deadline = time.monotonic() + drain_timeout_s
        while self._streams and time.monotonic() < deadline and self.is_healthy:
            await asyncio.sleep(0.05)
        for request_id in list(self._streams):
            self.abort(request_id)
        self._inbox.put(("shutdown", None))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)
        if self._log_task is not None:
            self._log_task.cancel()
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        self.metrics.engine_healthy.set(0)

    @property
    def is_healthy(self) -> bool:
        return (
            self._dead_error is None
            and self._thread is not None
            and self._thread.is_alive()
        )

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead_error

    def check_health(self) -> None:
        if self._is_shutting_down:
            raise EngineDeadError("the server is shutting down")
        if not self.is_healthy:
            raise EngineDeadError(f"the engine loop is not running: {self._dead_error!r}")

    @property
    def num_unfinished_requests(self) -> int:
        """Engine requests (children) accepted and not yet finished."""
        return len(self._children)

    def set_fault_hook(self, hook: Callable[[SchedulerOutput], None] | None) -> None:
        """Test-only: ``hook(scheduler_output)`` runs before every forward pass, on the
        thread that runs it; it may raise (a failing step) or sleep (a hung step)."""
        self._executor.fault_hook = hook

    def enable_finish_log(self, maxlen: int = 1_000_000) -> None:
        """Test-only: record every child's end in ``finish_log`` (bounded)."""
        if self.finish_log is None:
            self.finish_log = collections.deque(maxlen=maxlen)

    def set_step_timeout(self, step_timeout_s: float | None) -> None:
        self._executor.step_timeout_s = step_timeout_s

    # -- tokenization (off the loop and off the engine thread) --------------------------

    async def _in_pool(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_pool, lambda: fn(*args, **kwargs))

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._in_pool(
            lambda: list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        )

    async def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return await self._in_pool(
            self.tokenizer.decode, token_ids, skip_special_tokens=skip_special_tokens
        )

    async def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        return await self._in_pool(
            render_chat,
            self.tokenizer,
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
            tools=tools,
        )

    def token_str(self, token_id: int) -> str:
        """The text of one token, as OpenAI's logprobs show it (cached: the vocab is finite)."""
        s = self._token_str_cache.get(token_id)
        if s is None:
            s = self.tokenizer.decode([token_id])
            self._token_str_cache[token_id] = s
        return s

    # -- requests -------------------------------------------------------------------

    @staticmethod
    def new_request_id() -> str:
        return uuid.uuid4().hex

    async def generate(
        self,
        prompts: list[list[int]],
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        tenant: str = "default",
    ) -> AsyncIterator[CompletionDelta]:
        """Stream the deltas of ``len(prompts) * sampling_params.n`` child requests.

        Child ``i * n + j`` samples prompt ``i`` for the ``j``-th time (seed + j when a
        seed is set, as vLLM does). Leaving the iterator early aborts what is unfinished.
        Raises ``EngineDeadError`` when the engine is (or dies) unavailable,
        ``EngineStepError`` for a child whose step failed, ``RequestRejectedError`` when
        the scheduler refuses a child.
        """
        stream = self.add_request(
            prompts, sampling_params, request_id, priority=priority, tenant=tenant
        )
        try:
            while True:
                item = await stream.queue.get()
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
    ) -> _Stream:
        self.check_health()
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        n = sampling_params.n
        stream = _Stream(request_id, asyncio.Queue())
        now = time.monotonic()
        requests = []
        for i, prompt in enumerate(prompts):
            for j in range(n):
                index = i * n + j
                child_id = request_id if len(prompts) * n == 1 else f"{index}_{request_id}"
                params = sampling_params
                if n > 1 or params.seed is not None:
                    seed = None if params.seed is None else params.seed + j
                    params = dataclasses.replace(params, n=1, seed=seed)
                if self._extra_eos and not params.ignore_eos:
                    extra = [t for t in self._extra_eos if t not in params.stop_token_ids]
                    params = dataclasses.replace(
                        params, stop_token_ids=[*params.stop_token_ids, *extra]
                    )
                req = Request(
                    child_id,
                    prompt,
                    params,
                    arrival_time=now,
                    eos_token_id=self.eos_token_id,
                    priority=priority,
                    tenant=tenant,
                )
                requests.append(req)
                detok = None
                if self.tokenizer is not None:
                    detok = IncrementalDetokenizer(self.tokenizer, prompt, params)
                self._children[child_id] = _Child(index, req, stream, detok)
                stream.child_ids.append(child_id)
        stream.num_unfinished = len(requests)
        self._streams[request_id] = stream
        self._inbox.put(("add", requests))
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a parent request: its unfinished children end with ``abort`` now, and
        the engine frees their blocks before its next step. Idempotent."""
        stream = self._streams.get(request_id)
        if stream is None:
            return
        now = time.monotonic()
        ids = [cid for cid in stream.child_ids if cid in self._children]
        for cid in ids:
            child = self._children[cid]
            stream.queue.put_nowait(
                CompletionDelta(child.index, [], "", finish_reason="abort",
                                num_prompt_tokens=child.request.num_prompt_tokens)
            )
            self._finish_child(child, "abort", now)
        if ids:
            self._inbox.put(("abort", ids))

    # -- the engine thread ----------------------------------------------------------

    def _engine_loop(self) -> None:
        core = self.engine_core
        try:
            while True:
                if not self._drain_inbox(block=not core.has_unfinished_requests()):
                    return
                if core.has_unfinished_requests():
                    self._step()
        except BaseException as e:  # the loop is dead: tell everyone waiting
            logger.exception("engine loop died")
            self._dead_error = e
            self.metrics.engine_healthy.set(0)
            self._call_soon(self._fail_all, e)

    def _drain_inbox(self, block: bool) -> bool:
        """Apply queued adds and aborts; False when asked to stop."""
        try:
            item = self._inbox.get() if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        rejected: dict[str, str] = {}
        core = self.engine_core
        while True:
            kind, payload = item
            if kind == "shutdown":
                return False
            if kind == "add":
                for req in payload:
                    try:
                        core.add_request(req)
                    except ValueError as e:
                        rejected[req.request_id] = str(e)
            elif kind == "abort":
                core.abort_requests(payload)
            elif kind == "stop_string":  # finished on the loop by a stop string
                core.finish_requests(payload, RequestStatus.FINISHED_STOPPED)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
        self.metrics.observe_step(self._snapshot(), 0)
        if rejected:
            self._call_soon(self._on_rejected, rejected)
        return True

    def _step(self) -> None:
        core = self.engine_core
        self._executor.current = None
        core.last_scheduler_output = None
        try:
            outputs = core.step()
        except Exception as e:
            logger.exception("engine step failed; failing the requests it held")
            outputs = self._fail_step(e)
        sched_out = core.last_scheduler_output
        num_tokens = sched_out.total_num_scheduled_tokens if sched_out is not None else 0
        self.metrics.observe_step(self._snapshot(), num_tokens)
        if outputs:
            self._call_soon(self._on_outputs, outputs, time.monotonic())

    def _fail_step(self, exc: Exception) -> list[EngineCoreOutput]:
        """Finish the requests of a step that raised outside the executor with ``error``.

        (EngineCore already turns an executor failure into ``error`` outputs; this is the
        net for a failure in schedule/update.) The step's requests are known when the
        scheduler got that far; otherwise every running request is suspect.
        """
        core = self.engine_core
        sched_out = self._executor.current or getattr(core, "last_scheduler_output", None)
        ids = [r.request_id for r in sched_out.scheduled_requests] if sched_out else []
        ids = ids or [r.request_id for r in core.scheduler.running]
        # Nothing running to blame (schedule() itself fails): fail everything, or the
        # loop would spin on the same error with the waiting requests never answered.
        ids = ids or list(core.scheduler.requests)
        return core.fail_requests(ids, f"{type(exc).__name__}: {exc}")

    def _snapshot(self) -> SchedulerSnapshot:
        # Read live state rather than scheduler.stats: stats are taken in schedule(),
        # before the step's finishes, and the gauges must read 0 once the engine drains.
        sched = self.engine_core.scheduler
        kv = sched.kv
        return SchedulerSnapshot(
            num_running=len(sched.running),
            num_waiting=sched.num_waiting,
            kv_cache_usage=kv.usage,
            num_free_blocks=kv.num_free_blocks,
            num_blocks=kv.num_blocks,
            num_preemptions=sched.num_preemptions,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
        )

    def _call_soon(self, fn: Callable, *args: Any) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        # The loop may close between the check and the call.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(fn, *args)

    # -- back on the event loop --------------------------------------------------------

    def _on_outputs(self, outputs: list[EngineCoreOutput], now: float) -> None:
        metrics = self.metrics
        num_prompt = num_generated = 0
        stopped: list[str] = []
        for out in outputs:
            child = self._children.get(out.request_id)
            if child is None:  # aborted, or ended by a stop string, on this side already
                continue
            n_new = len(out.new_token_ids)
            if n_new:
                if child.first_token_time is None:
                    child.first_token_time = now
                    metrics.time_to_first_token.observe(now - child.request.arrival_time)
                    num_prompt += child.request.num_prompt_tokens
                elif child.last_token_time is not None:
                    gap = (now - child.last_token_time) / n_new
                    for _ in range(n_new):
                        metrics.inter_token_latency.observe(gap)
                child.last_token_time = now
                child.num_output_tokens += n_new
                num_generated += n_new
            finish, stop_reason = out.finish_reason, out.stop_reason
            if finish == "error":
                child.stream.queue.put_nowait(EngineStepError(str(stop_reason or "step failed")))
                self._finish_child(child, finish, now)
                continue
            text = out.new_text or ""
            detok = child.detokenizer
            if detok is not None:
                if n_new:
                    text, hit = detok.update(out.new_token_ids, finished=finish is not None)
                    if hit:
                        if finish is None:
                            stopped.append(out.request_id)
                        finish, stop_reason = "stop", detok.stop_reason
                elif finish is not None:
                    text = detok.flush()
            child.stream.queue.put_nowait(
                CompletionDelta(
                    child.index,
                    list(out.new_token_ids),
                    text,
                    out.new_logprobs,
                    finish,
                    stop_reason,
                    child.request.num_prompt_tokens,
                )
            )
            if finish is not None:
                self._finish_child(child, finish, now)
        metrics.observe_tokens(num_prompt, num_generated)
        if stopped:
            self._inbox.put(("stop_string", stopped))

    def _on_rejected(self, rejected: dict[str, str]) -> None:
        now = time.monotonic()
        for cid, msg in rejected.items():
            child = self._children.get(cid)
            if child is None:
                continue
            stream = child.stream
            # The whole parent fails: its siblings are aborted so nothing is left behind.
            stream.queue.put_nowait(RequestRejectedError(msg))
            self._finish_child(child, "error", now)
            siblings = [c for c in stream.child_ids if c in self._children]
            for sid in siblings:
                self._finish_child(self._children[sid], "abort", now)
            if siblings:
                self._inbox.put(("abort", siblings))

    def _finish_child(self, child: _Child, finish_reason: str, now: float) -> None:
        req = child.request
        del self._children[req.request_id]
        first = req.first_scheduled_time
        self.metrics.observe_finished(
            finish_reason,
            now - req.arrival_time,
            first - req.arrival_time if first is not None else None,
        )
        stream = child.stream
        if self.finish_log is not None:
            self.finish_log.append((stream.request_id, child.index, finish_reason))
        stream.num_unfinished -= 1
        if stream.num_unfinished == 0:
            stream.queue.put_nowait(_END)
            self._streams.pop(stream.request_id, None)

    def _fail_all(self, exc: BaseException) -> None:
        err = EngineDeadError(f"the engine loop died: {type(exc).__name__}: {exc}")
        now = time.monotonic()
        for stream in list(self._streams.values()):
            stream.queue.put_nowait(err)
            for cid in list(stream.child_ids):
                child = self._children.get(cid)
                if child is not None:
                    self._finish_child(child, "error", now)

    async def _log_stats_forever(self) -> None:
        while True:
            await asyncio.sleep(self.log_stats_interval_s)
            line = self.metrics.log_line()
            if line:
                logger.info(line)
