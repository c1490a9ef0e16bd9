"""glibc's heap: freed memory given back to the OS (Linux; a no-op elsewhere).

glibc keeps what a process frees for its next allocations, and after a long prefill
that is the step's activations: Qwen2-0.5B at 2,048 batched tokens held ~180 MB more
after its first steps than while idle. The runner gives it back after each step of many
tokens (``TRIM_AFTER_TOKENS``); the next such step takes its pages again, a cost that
did not show beside the step's GEMMs (a fixed mmap threshold, the other remedy, cost
such steps 8%: every block unmapped and faulted in again)."""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

TRIM_AFTER_TOKENS = 256


def malloc_trim() -> None:
    """Give freed heap back to the OS (glibc keeps it otherwise: a huge request's
    buffers would stay in RSS for good)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _load_libc() -> Any:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


_LIBC = _load_libc()
