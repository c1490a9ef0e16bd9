"""Thread pools for a request's expensive preparation, below the engine in priority.

On a machine of few cores, a flood of large bodies, long texts or huge grammars would
otherwise take CPU from the engine thread in equal shares, and every other client's
next token waits for it. Linux gives each thread its own nice value, so the threads of
these pools run at a lower priority (``background_nice()`` above the process's; the
server's ``--background-nice``): the engine and the event loop preempt them, and they
still use every idle cycle. Elsewhere (no per-thread priority, or no permission) the
pools run at normal priority.

A lower priority only helps work that lets go of the interpreter: a thread holding the
GIL stalls the event loop and the engine whatever its nice value. Hugging Face
tokenizers release it in ``encode_batch`` only (``Tokenizer.encode`` holds it for the
whole text), so the pools' tokenization goes through ``encode_batch``; and with
``TOKENIZERS_PARALLELISM`` on, a batch runs on Rayon's threads, at their own priority,
so the server turns it off (``keep_tokenizers_on_caller``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
from collections.abc import Callable

# Niceness added to a background thread: low enough that the engine preempts it, not
# so low that a request's own preparation starves on a machine that is merely busy.
BACKGROUND_NICE = 10
_nice = BACKGROUND_NICE
# How a background thread yields: "idle" is Linux's SCHED_IDLE (it runs only on cycles
# nothing else wants, and a waking engine thread preempts it at once; a niced thread
# keeps the core for its time slice, which on 2 cores tripled the other clients' p99);
# "nice" is the niceness alone. Where SCHED_IDLE is missing or refused, "nice" applies.
BACKGROUND_POLICIES = ("idle", "nice")
BACKGROUND_POLICY = "idle"
_policy = BACKGROUND_POLICY


def background_nice() -> int:
    """The niceness background threads started from now on add to the process's."""
    return _nice


def set_background_nice(nice: int) -> None:
    """Set ``background_nice()`` (0: normal priority); threads already running keep
    theirs, so set it before serving (the pools start their threads on first use)."""
    global _nice
    if not 0 <= nice <= 19:
        raise ValueError(f"background_nice must be in 0..19, got {nice}")
    _nice = nice


def background_policy() -> str:
    """How background threads started from now on yield: "idle" or "nice"."""
    return _policy


def set_background_policy(policy: str) -> None:
    """Set ``background_policy()``; like the niceness, read as each thread starts."""
    global _policy
    if policy not in BACKGROUND_POLICIES:
        raise ValueError(f"background_policy must be one of {', '.join(BACKGROUND_POLICIES)}, "
                         f"got {policy!r}")
    _policy = policy


def keep_tokenizers_on_caller() -> None:
    """Have Hugging Face tokenizers run a batch on the calling thread (at its priority),
    not on Rayon's pool (whose threads have whatever priority their creator had),
    unless ``TOKENIZERS_PARALLELISM`` was set explicitly."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _lower_priority(nice: int | Callable[[], int] | None, idle: bool) -> None:
    if not hasattr(os, "setpriority"):
        return
    nice = _nice if nice is None else nice() if callable(nice) else nice
    if nice <= 0:
        return
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):  # a sandbox may refuse; normal priority then
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, current + nice))
    if idle and _policy == "idle" and hasattr(os, "SCHED_IDLE"):
        with contextlib.suppress(OSError):  # refused: the niceness above stands
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))


def background_pool(
    max_workers: int, thread_name_prefix: str, nice: int | Callable[[], int] | None = None,
    idle: bool = True,
) -> concurrent.futures.ThreadPoolExecutor:
    """A ThreadPoolExecutor whose threads run ``nice`` below the process's priority:
    a number, or a function read as each thread starts (default: ``background_nice``);
    and, with ``idle`` and ``background_policy()`` "idle", as SCHED_IDLE (niceness 0
    keeps normal priority either way)."""
    return concurrent.futures.ThreadPoolExecutor(
        max_workers, thread_name_prefix=thread_name_prefix,
        initializer=_lower_priority, initargs=(nice, idle))
