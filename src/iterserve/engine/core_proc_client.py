"""The API server's side of the engine core process (vLLM V1's ``AsyncMPClient``).

``EngineCoreProcClient`` has the interface of ``EngineCoreThread`` (``send``, ``start``,
``join``, ``is_alive``, ``dead_error``), so ``AsyncLLM`` drives either. It spawns
``engine.core_proc.run_engine_core``, waits for its handshake (``Ready``, or the error
that stopped it, raised here as ``EngineStartupError``: the server never starts on a
half-built engine and never hangs on one), then speaks ZMQ over two IPC sockets:

- server -> engine: the messages of one event-loop turn go out as one ``EngineInputs``
  (flushed by a ``call_soon``), so a burst of requests costs one message;
- engine -> server: one ``StepOutputs`` per step, read by a task on the event loop and
  handed to ``AsyncLLM`` as an ``EngineCoreOutputs``, as the thread's callback does.
  The step's stats go to the server's ``Metrics``, so ``/metrics`` shows the engine's
  gauges and counters beside the server's own.

The engine process's exit is watched on the loop (its sentinel fd): a death fails every
in-flight request with ``EngineDeadError`` and turns ``/health`` unhealthy.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import shutil
import tempfile
import time
import types
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from iterserve.core.slo import AdmissionRefused
from iterserve.engine import core_proc_messages as m
from iterserve.engine.core_thread import AbortRequests, AddRequests, FinishRequests, Shutdown
from iterserve.engine.exceptions import EngineDeadError
from iterserve.engine.step_guard import make_fault_hook
from iterserve.engine.structured_output import StructuredOutputManager

logger = logging.getLogger("iterserve.async_llm")

DEFAULT_STARTUP_TIMEOUT_S = 1800.0  # a large model's load and warm-up on a slow disk


class EngineStartupError(RuntimeError):
    """The engine core process could not start; the message is its error."""


class _ServerGrammars(StructuredOutputManager):
    """The server's grammar manager: it checks and compiles each request's grammar at
    admission (the limits, the time budget, a 400 for a bad one), as in one process;
    its limits are forwarded to the engine's manager, which compiles for the matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int,
                 forward: Callable[[m.ConfigureGrammar], None]) -> None:
        super().__init__(tokenizer, vocab_size)
        self._forward = forward

    def configure(self, limits: Any) -> None:
        super().configure(limits)
        self._forward(m.ConfigureGrammar(dataclasses.asdict(limits)))


class RemoteEngineCore:
    """What ``AsyncLLM`` reads of its engine core when that runs in another process."""

    step_guard = None

    def __init__(self, structured_outputs: StructuredOutputManager) -> None:
        self.structured_outputs = structured_outputs


def async_llm_over_process(cls: Any, engine_config: Any, step_timeout_s: float | None,
                           **kwargs: Any) -> Any:
    """``AsyncLLM.from_engine_config(..., engine_core_process=True)``: start the engine
    core process, then build ``cls`` (``AsyncLLM``) on its handshake, the tokenizer
    loaded here."""
    from iterserve.model.generation_config import sampling_defaults
    from iterserve.model.loader import load_tokenizer

    client = EngineCoreProcClient(engine_config, step_timeout_s=step_timeout_s)
    try:
        ready = client.ready
        tokenizer = load_tokenizer(ready.tokenizer_path)
        kwargs.setdefault("max_model_len", ready.max_model_len)
        kwargs.setdefault("eos_token_ids", ready.eos_token_ids)
        kwargs.setdefault("vocab_size", ready.vocab_size)
        kwargs.setdefault("long_rope_after", ready.long_rope_after)
        kwargs.setdefault("stream_interval", ready.stream_interval)
        kwargs.setdefault("sampling_defaults", sampling_defaults(
            ready.model_path, engine_config.generation_config))
        core = RemoteEngineCore(client.server_grammars(tokenizer))
        return cls(core, tokenizer, core_client=client, **kwargs)
    except BaseException:
        client.join(0)
        client.close()
        raise


class EngineCoreProcClient:
    """Spawns the engine core process and relays messages; see the module docstring."""

    def __init__(self, engine_config: Any, *, step_timeout_s: float | None = None,
                 startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S) -> None:
        from iterserve.engine.builder import config_to_dict
        from iterserve.engine.core_proc import run_engine_core

        self.dead_error: BaseException | None = None
        self.stats: m.WireStats | None = None
        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._adds: list[m.WireRequest] = []
        self._finishes: list[str] = []
        self._aborts: list[str] = []
        self._flush_scheduled = False
        self._encoder = msgspec.msgpack.Encoder()
        self._dir = tempfile.mkdtemp(prefix="iterserve-engine-")
        input_addr, output_addr = f"ipc://{self._dir}/input", f"ipc://{self._dir}/output"
        self._ctx = zmq.Context(1)
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)  # never block the loop on a send
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.bind(input_addr)
        self._output_sync = self._ctx.socket(zmq.PULL)
        self._output_sync.setsockopt(zmq.RCVHWM, 0)
        self._output_sync.setsockopt(zmq.LINGER, 0)
        self._output_sync.bind(output_addr)
        ctx = multiprocessing.get_context("spawn")  # torch is not fork-safe once it ran
        self._conn, child_conn = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(
            target=run_engine_core, name="iterserve-engine-core",
            args=(config_to_dict(engine_config), step_timeout_s, input_addr, output_addr, child_conn,
                  logging.getLogger().getEffectiveLevel()))
        try:
            self.proc.start()
            child_conn.close()
            self.ready = self._handshake(startup_timeout_s)
        except BaseException:
            self._kill()
            self._close_sockets()
            raise
        self.cache_config = types.SimpleNamespace(**self.ready.cache_config)

    def _handshake(self, timeout_s: float) -> m.Ready:
        decoder = msgspec.msgpack.Decoder(m.FromEngine)
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(0.1):
            if not self.proc.is_alive():
                raise EngineStartupError(
                    f"the engine core process exited (code {self.proc.exitcode}) before "
                    "it was ready")
            if time.monotonic() > deadline:
                raise EngineStartupError(f"the engine core process was not ready in "
                                         f"{timeout_s:.0f} s")
        try:
            msg = decoder.decode(self._conn.recv_bytes())
        except EOFError:
            self.proc.join(5)
            raise EngineStartupError(
                f"the engine core process exited (code {self.proc.exitcode}) before it was "
                "ready") from None
        if isinstance(msg, m.StartupFailed):
            raise EngineStartupError(f"the engine core failed to start: {msg.error}")
        assert isinstance(msg, m.Ready)
        return msg

    def bind(self, metrics: Any, output_processor: Any, *,
             on_outputs: Callable[[Any, float], None],
             on_rejected: Callable[[dict[str, ValueError]], None],
             on_dead: Callable[[BaseException], None]) -> None:
        self.metrics = metrics
        self.output_processor = output_processor
        self.on_outputs = on_outputs
        self.on_rejected = on_rejected
        self.on_dead = on_dead

    def server_grammars(self, tokenizer: Any) -> StructuredOutputManager:
        return _ServerGrammars(tokenizer, self.ready.vocab_size, self.send_control)

    # -- lifecycle ----------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._output = zmq.asyncio.Socket.from_socket(self._output_sync)
        self._task = loop.create_task(self._recv_forever())
        loop.add_reader(self.proc.sentinel, self._on_exit)
        if self.proc.exitcode is not None:  # died before the loop watched it
            loop.call_soon(self._on_exit)

    @property
    def is_alive(self) -> bool:
        return self.dead_error is None and not self._closing and self.proc.is_alive()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the process to exit (after ``Shutdown``), then make sure it has."""
        self._closing = True
        self.proc.join(timeout)
        self._kill()

    async def aclose(self) -> None:
        """On the loop, after ``join``: stop reading, then close the sockets."""
        self._closing = True
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(Exception):
                loop.remove_reader(self.proc.sentinel)
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._close_sockets()

    def close(self) -> None:
        """Close without a loop (a client that never started)."""
        self._closing = True
        self._close_sockets()

    def _kill(self) -> None:
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)

    def _close_sockets(self) -> None:
        if self._ctx.closed:
            return
        with contextlib.suppress(Exception):
            self._conn.close()
        self._input.close(linger=0)
        self._output_sync.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    # -- server -> engine ---------------------------------------------------------------

    def send(self, message: Any) -> None:
        """Queue ``message`` (an ``engine.core_thread`` inbox message) for this loop
        turn's ``EngineInputs``; ``Shutdown`` goes out at once. Call on the loop."""
        if isinstance(message, AddRequests):
            self._adds.extend(m.request_to_wire(r) for r in message.requests)
        elif isinstance(message, AbortRequests):
            self._aborts.extend(message.request_ids)
        elif isinstance(message, FinishRequests):
            self._finishes.extend(message.request_ids)
        elif isinstance(message, Shutdown):
            self._flush()
            self.send_control(m.Shutdown())
            return
        else:
            raise TypeError(f"unknown engine message {message!r}")
        if not self._flush_scheduled:
            self._flush_scheduled = True
            if self._loop is None:
                self._flush()
            else:
                self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if not (self._adds or self._finishes or self._aborts):
            return
        msg = m.EngineInputs(self._adds, self._finishes, self._aborts)
        self._adds, self._finishes, self._aborts = [], [], []
        self.send_control(msg)

    def set_fault(self, kind: str, count: int, seconds: float) -> None:
        make_fault_hook(kind, count, seconds)  # a bad kind is a ValueError here
        self.send_control(m.SetFault(kind, count, seconds))

    def set_step_timeout(self, step_timeout_s: float | None) -> None:
        self.send_control(m.SetStepTimeout(step_timeout_s))

    def kv_state(self) -> dict[str, int]:
        """As of the latest step (empty before the first)."""
        s = self.stats
        if s is None:
            return {}
        return {"num_free_blocks": s.num_free_blocks, "num_blocks": s.num_blocks,
                "num_leak_reports": s.num_leak_reports}

    def send_control(self, msg: Any) -> None:
        if self._closing or self.dead_error is not None:
            return
        with contextlib.suppress(zmq.ZMQError):  # a closed socket: the engine is gone
            self._input.send(self._encoder.encode(msg), zmq.NOBLOCK, copy=False)

    # -- engine -> server (on the loop) --------------------------------------------------

    async def _recv_forever(self) -> None:
        decoder = msgspec.msgpack.Decoder(m.FromEngine)
        sock = self._output
        try:
            while True:
                raw = await sock.recv(copy=False)
                msg = decoder.decode(raw.buffer)
                if isinstance(msg, m.StepOutputs):
                    self._on_step(msg)
                elif isinstance(msg, m.EngineDead):
                    self._dead(EngineDeadError(f"the engine core process died: {msg.error}"))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # a reader that stops must not leave streams hanging
            if self._closing:
                return
            logger.exception("reading the engine core's outputs failed")
            self._dead(e)
            self._kill()

    def _on_step(self, msg: m.StepOutputs) -> None:
        if msg.updates:
            states = self.output_processor.request_states
            for u in msg.updates:
                state = states.get(u.request_id)
                if state is not None:
                    m.apply_update(state.request, u)
        stats = self.stats = msg.stats
        self.metrics.observe_step(m.snapshot_of(stats), stats.num_scheduled_tokens)
        if msg.rejected:
            self.on_rejected({rid: (AdmissionRefused(text) if refused else ValueError(text))
                              for rid, refused, text in msg.rejected})
        if msg.req_ids or msg.finished:
            self.on_outputs(m.outputs_from_wire(msg), msg.time)

    def _on_exit(self) -> None:
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(Exception):
                loop.remove_reader(self.proc.sentinel)
        self.proc.join(1)
        if self._closing:
            return
        self._dead(EngineDeadError(
            f"the engine core process died (exit code {self.proc.exitcode})"))

    def _dead(self, exc: BaseException) -> None:
        if self.dead_error is not None or self._closing:
            return
        self.dead_error = exc
        self.metrics.engine_healthy.set(0)
        self.on_dead(exc)
