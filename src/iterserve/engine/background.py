"""Thread pools for a request's expensive preparation, below the engine in priority.

On a machine of few cores, a flood of large bodies, long texts or huge grammars would
otherwise take CPU from the engine thread in equal shares, and every other client's
next token waits for it. Linux gives each thread its own nice value, so the threads of
these pools run at a lower priority (``BACKGROUND_NICE`` above the process's): the engine
and the event loop preempt them, and they still use every idle cycle. Elsewhere (no
per-thread priority, or no permission) the pools run at normal priority.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading

# Niceness added to a background thread: low enough that the engine preempts it, not
# so low that a request's own preparation starves on a machine that is merely busy.
BACKGROUND_NICE = 10


def _lower_priority(nice: int) -> None:
    if not hasattr(os, "setpriority"):
        return
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):  # a sandbox may refuse; normal priority then
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, current + nice))


def background_pool(max_workers: int, thread_name_prefix: str,
                    nice: int = BACKGROUND_NICE) -> concurrent.futures.ThreadPoolExecutor:
    """A ThreadPoolExecutor whose threads run ``nice`` below the process's priority."""
    return concurrent.futures.ThreadPoolExecutor(
        max_workers, thread_name_prefix=thread_name_prefix,
        initializer=_lower_priority, initargs=(nice,))
