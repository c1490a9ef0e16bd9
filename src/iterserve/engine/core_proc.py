"""The engine core in a process of its own (``serve --engine-core-process``), as vLLM
V1's ``EngineCoreProc``: this process owns the scheduler and the model; the API server
(``engine.core_proc_client``) owns HTTP, tokenization, detokenization and streaming.

Started with the spawn method (torch must not be forked after it started threads).
The loop: drain the input socket (one ``EngineInputs`` per server event-loop turn),
step, send the step's outputs and stats as one ``StepOutputs``. It blocks on the
socket only when it holds no request. Grammars compile on a thread of this process,
so a slow compile never holds a step; the request joins the scheduler when it is done.

Lifetime: the pipe to the parent carries the handshake (``Ready``, or ``StartupFailed``
with the error that stopped the build) and then watches the parent: when the parent
dies, the pipe reads EOF and this process exits at once (no orphan holds the model).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import signal
import threading
import time
import traceback
from typing import Any

import msgspec
import zmq

from iterserve.core.request import Request, RequestStatus
from iterserve.engine import core_proc_messages as m
from iterserve.engine.grammar_limits import GrammarLimits
from iterserve.engine.step_guard import StepGuard, make_fault_hook

logger = logging.getLogger("iterserve.engine_core_proc")


def _watch_parent(conn: Any) -> None:
    """Exit this process when the parent's end of the pipe closes (the parent died)."""
    try:
        while True:
            conn.recv_bytes()
    except (EOFError, OSError):
        pass
    os._exit(1)


def run_engine_core(engine_config: dict[str, Any], step_timeout_s: float | None,
                    input_addr: str, output_addr: str, conn: Any, log_level: int) -> None:
    """The process's entry point (top level, so spawn can import it); ``engine_config``
    as ``builder.config_to_dict`` gives it (the compiled configs do not pickle)."""
    logging.basicConfig(level=log_level,
                        format="%(levelname)s %(asctime)s %(name)s [engine core]: %(message)s")
    # The terminal's Ctrl-C reaches the whole process group: the server shuts this
    # process down (or its death closes the pipe), so the signal is the server's alone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Watch from the start: a server that dies during a long load leaves no orphan.
    threading.Thread(target=_watch_parent, args=(conn,), name="iterserve-parent-watch",
                     daemon=True).start()
    encoder = msgspec.msgpack.Encoder()
    try:
        from iterserve.engine.builder import config_from_dict

        proc = EngineCoreProc(config_from_dict(engine_config), step_timeout_s, input_addr,
                              output_addr)
    except BaseException as e:  # the server's start fails with this, it never hangs
        logger.exception("engine core failed to start")
        text = "".join(traceback.format_exception_only(type(e), e)).strip()
        conn.send_bytes(encoder.encode(m.StartupFailed(text)))
        os._exit(1)
    conn.send_bytes(encoder.encode(proc.ready))
    code = proc.run()
    os._exit(code)


class EngineCoreProc:
    """Build the engine (``build_engine_and_config``) and serve it over two ZMQ sockets."""

    def __init__(self, engine_config: Any, step_timeout_s: float | None, input_addr: str,
                 output_addr: str) -> None:
        from iterserve.engine.builder import build_engine_and_config
        from iterserve.model.loader import resolve_model_path

        self.core, tokenizer, model_config, cfg = build_engine_and_config(
            engine_config, step_guard=StepGuard(step_timeout_s))
        del tokenizer  # the server detokenizes; the grammar manager keeps its own reference
        path = str(resolve_model_path(engine_config.model))
        cache = self.core.scheduler.cache_config
        self.ready = m.Ready(
            tokenizer_path=str(engine_config.tokenizer or path), model_path=str(path),
            max_model_len=self.core.scheduler.max_model_len,
            vocab_size=model_config.vocab_size,
            eos_token_ids=list(getattr(model_config, "eos_token_ids", []) or []),
            long_rope_after=getattr(model_config, "long_rope_after", None),
            stream_interval=cfg.scheduler.stream_interval,
            cache_config={k: str(getattr(cache, k)) for k in cache.__dataclass_fields__},
            pid=os.getpid())
        self.ctx = zmq.Context(1)
        self.input = self.ctx.socket(zmq.PULL)
        self.input.connect(input_addr)
        self.output = self.ctx.socket(zmq.PUSH)
        self.output.setsockopt(zmq.LINGER, 2000)
        self.output.connect(output_addr)
        self.decoder = msgspec.msgpack.Decoder(m.ToEngine)
        self.encoder = msgspec.msgpack.Encoder()
        # Requests the server still follows: their first token and their end carry a
        # RequestUpdate (what the server's output processor reads from a request).
        self.requests: dict[str, Request] = {}
        self.unreported: set[str] = set()
        # Grammar compiles in flight (request id -> request) and those done.
        self.compiling: dict[str, Request] = {}
        self.compiled: queue.SimpleQueue[tuple[Request, BaseException | None]] = (
            queue.SimpleQueue())
        self._compile_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.rejected: list[tuple[str, bool, str]] = []

    # -- the loop ---------------------------------------------------------------------

    def run(self) -> int:
        core = self.core
        try:
            while True:
                busy = core.has_unfinished_requests()
                timeout = 0 if busy else (2 if self.compiling else None)
                if not self._drain(timeout):
                    return 0
                self._add_compiled()
                if core.has_unfinished_requests():
                    self._step()
                elif busy or self.rejected:
                    self._send(None)  # went idle by an abort: the gauges must read 0
        except BaseException as e:  # the loop is dead: say why before the process ends
            logger.exception("engine core loop died")
            try:
                msg = m.EngineDead(f"{type(e).__name__}: {e}")
                self.output.send(self.encoder.encode(msg))
            finally:
                self.output.close(linger=1000)
            return 1

    def _drain(self, timeout: int | None) -> bool:
        """Apply every queued message (waiting up to ``timeout`` ms for the first);
        False on Shutdown."""
        sock = self.input
        if not sock.poll(timeout):
            return True
        while True:
            try:
                raw = sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            msg = self.decoder.decode(raw.buffer)
            if isinstance(msg, m.EngineInputs):
                self._apply(msg)
            elif isinstance(msg, m.Shutdown):
                return False
            elif isinstance(msg, m.SetFault):
                self._guard().fault_hook = (None if msg.kind == "none" else
                                            make_fault_hook(msg.kind, msg.count, msg.seconds))
            elif isinstance(msg, m.SetStepTimeout):
                self._guard().step_timeout_s = msg.step_timeout_s
            elif isinstance(msg, m.ConfigureGrammar):
                so = self.core.structured_outputs
                if so is not None:
                    so.configure(GrammarLimits(**msg.limits))

    def _guard(self) -> StepGuard:
        guard = self.core.step_guard
        assert guard is not None  # built with one above
        return guard

    def _apply(self, msg: m.EngineInputs) -> None:
        core = self.core
        for w in msg.adds:
            try:
                req = m.request_from_wire(w)
            except ValueError as e:
                self.rejected.append((w.request_id, False, str(e)))
                continue
            if req.sampling_params.structured_outputs is not None:
                self._compile(req)
            else:
                self._add(req)
        if msg.finishes:
            core.finish_requests(msg.finishes, RequestStatus.FINISHED_STOPPED)
            self._forget(msg.finishes)
        if msg.aborts:
            core.abort_requests(msg.aborts)
            self._forget(msg.aborts)

    def _add(self, req: Request) -> None:
        from iterserve.core.slo import AdmissionRefused

        try:
            self.core.add_request(req)
        except ValueError as e:
            self.rejected.append((req.request_id, isinstance(e, AdmissionRefused), str(e)))
            return
        self.requests[req.request_id] = req
        self.unreported.add(req.request_id)

    def _forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.requests.pop(rid, None)
            self.unreported.discard(rid)
            self.compiling.pop(rid, None)  # a compile in flight: its result is dropped

    # -- grammars ----------------------------------------------------------------------

    def _compile(self, req: Request) -> None:
        so = self.core.structured_outputs
        if so is None:
            self.rejected.append((req.request_id, False,
                                  "structured_outputs: not supported by this engine"))
            return
        if self._compile_pool is None:
            self._compile_pool = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="iterserve-grammar")
        self.compiling[req.request_id] = req
        params = req.sampling_params.structured_outputs

        def run() -> None:
            try:
                so.compile(params)
                self.compiled.put((req, None))
            except BaseException as e:
                self.compiled.put((req, e))

        self._compile_pool.submit(run)

    def _add_compiled(self) -> None:
        while True:
            try:
                req, err = self.compiled.get_nowait()
            except queue.Empty:
                return
            if self.compiling.pop(req.request_id, None) is None:
                continue  # aborted while it compiled
            if err is not None:
                self.rejected.append((req.request_id, False, str(err)))
            else:
                self._add(req)

    # -- steps --------------------------------------------------------------------------

    def _step(self) -> None:
        core = self.core
        try:
            outputs = core.step()
        except Exception as e:  # schedule/update failed: fail the step's requests
            logger.exception("engine step failed; failing the requests it held")
            from iterserve.engine.core_thread import fail_step

            outputs = fail_step(core, e)
        self._send(outputs)

    def _send(self, outputs: Any) -> None:
        core = self.core
        sched = core.scheduler
        updates: list[m.RequestUpdate] = []
        if outputs is None:
            req_ids: list[str] = []
            token_ids: list[int] = []
            lps = None
            finished: list[m.WireFinal] = []
            multi: list[m.WireFinal] = []
            num_tokens = 0
        else:
            req_ids, token_ids, lps, finished, multi = m.outputs_to_wire(outputs)
            requests = self.requests
            first = self.unreported.intersection(req_ids) if self.unreported else ()
            for rid in first:
                self.unreported.discard(rid)
                updates.append(m.update_of(requests[rid]))
            for rid in outputs.finished:
                req = requests.pop(rid, None)
                self.unreported.discard(rid)
                if req is not None:
                    updates.append(m.update_of(req))
            so = core.last_scheduler_output
            num_tokens = so.total_num_scheduled_tokens if so is not None else 0
        kv = sched.kv
        stats = m.WireStats(len(sched.running), sched.num_waiting, kv.usage, kv.num_free_blocks,
                            kv.num_blocks, sched.num_preemptions, kv.prefix_cache_queries,
                            kv.prefix_cache_hits, num_tokens, core.num_leak_reports)
        spec = sched.spec.stats if sched.spec is not None else None
        if spec is not None:
            stats.spec_num_drafts = spec.num_drafts
            stats.spec_num_draft_tokens = spec.num_draft_tokens
            stats.spec_num_accepted_tokens = spec.num_accepted_tokens
            stats.spec_accepted_per_pos = list(spec.accepted_per_pos)
        rejected, self.rejected = self.rejected, []
        msg = m.StepOutputs(req_ids, token_ids, lps, finished, updates, stats, rejected,
                            time.monotonic(), multi)
        self.output.send(self.encoder.encode(msg), copy=False)
