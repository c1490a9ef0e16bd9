"""Grammar compiles off the event loop, on threads of their own, with a time limit.

A request's grammar is measured first, on the loop (a walk that stops at the size cap);
over the cap it is refused there. The rest compile on two pools that share nothing
with tokenization or asyncio's default executor: grammars up to ``SMALL_GRAMMAR_BYTES``
on one thread of their own, larger ones on ``GrammarLimits.compile_threads``. A flood
of huge grammars therefore never queues a small one, and never takes more than its
threads' share of the CPU from the engine (llguidance compiles without the GIL), and
those threads run below the engine's priority (the large ones as SCHED_IDLE, by default).

Each compile has ``compile_timeout_s`` from being queued to being done. Past it the
request is refused (``GrammarTimeoutError``, a 400 naming the limit) and the work is
abandoned: a compile still queued never runs, one running finishes on its thread (a
thread cannot be stopped) but its result is neither cached nor kept, and its memory
goes back when it ends. The same happens when the client goes away mid-compile.
"""

from __future__ import annotations

import asyncio
from typing import Any

from iterserve.core.sampling_params import StructuredOutputsParams
from iterserve.engine.background import background_nice, background_pool
from iterserve.engine.grammar_limits import SMALL_GRAMMAR_BYTES, GrammarLimitError


class GrammarTimeoutError(GrammarLimitError):
    """A compile that did not finish within the limit."""


class GrammarPool:
    """Compiles through ``manager.compile`` (engine.structured_output)."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        threads = manager.limits.compile_threads
        # Both below the engine's priority (engine.background): a compile never holds
        # a decode step back. The small pool is niced half as much and never SCHED_IDLE:
        # its work is bounded (a few ms), and a saturated engine leaves idle threads
        # seconds between cycles, too long for an ordinary JSON schema.
        self._small = background_pool(1, "iterserve-grammar-small",
                                      nice=lambda: background_nice() // 2, idle=False)
        self._large = background_pool(threads, "iterserve-grammar")

    async def compile(self, params: StructuredOutputsParams) -> None:
        """Compile ``params`` (``params.compiled`` is set); ValueError naming the field
        when it is invalid or over a limit."""
        manager = self.manager
        limits = manager.limits
        size = manager.check(params)
        pool = self._small if size <= SMALL_GRAMMAR_BYTES else self._large
        in_time = [True]
        fut = pool.submit(manager.compile, params, lambda: in_time[0])
        done = False
        try:
            await asyncio.wait_for(asyncio.wrap_future(fut), limits.compile_timeout_s)
            done = True
        except TimeoutError:
            raise GrammarTimeoutError(
                f"structured_outputs.{params.kind}: compiling the grammar took longer than "
                f"{limits.compile_timeout_s:g} s (the server's "
                "--structured-outputs-compile-timeout)") from None
        finally:
            if not done:  # timed out, failed, or the request went away: abandon it
                in_time[0] = False
                fut.cancel()

    def shutdown(self) -> None:
        for pool in (self._small, self._large):
            pool.shutdown(wait=False, cancel_futures=True)
