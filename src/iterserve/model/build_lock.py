"""The lock around a C++ kernel build that a killed build never leaves behind.

torch's extension builder guards a build folder with a lock *file* (``lock``, its
``FileBaton``): created when a build starts, removed when it ends, waited on for ever
by every other process while it exists. A process killed mid-build (Ctrl-C in the
first start's build) leaves the file behind, and every later start then waits on it,
printing nothing.

``build_lock`` takes a lock of our own first: an ``flock`` on ``iterserve.lock`` in the
build folder, which the kernel releases when its owner exits, however it exits. The
owner writes its pid into the file, so a process that has to wait says for whom. A
torch lock file found while we hold our lock is stale by construction (every iterserve
build of the folder holds our lock before torch takes its own): its builder is gone,
and it is removed, with a warning, before torch looks for it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

fcntl: ModuleType | None
try:
    import fcntl
except ImportError:  # not a POSIX system: torch's own lock alone
    fcntl = None

logger = logging.getLogger("iterserve.model.cpu_ops")

LOCK_NAME = "iterserve.lock"
TORCH_LOCK_NAME = "lock"  # torch.utils.file_baton.FileBaton's file in the build folder
# How long a start waits for another live process's build before giving up on the
# kernels (it then runs the torch kernels, with a warning).
DEFAULT_TIMEOUT_S = 600.0


@contextlib.contextmanager
def build_lock(build_dir: Path, timeout_s: float | None = None) -> Iterator[None]:
    """Hold the build folder's lock (creating the folder); raises ``TimeoutError`` when
    another live process has held it for longer than ``timeout_s`` (default
    ``$ITERSERVE_BUILD_LOCK_TIMEOUT``, else 600 s)."""
    if timeout_s is None:
        timeout_s = float(os.environ.get("ITERSERVE_BUILD_LOCK_TIMEOUT") or DEFAULT_TIMEOUT_S)
    if fcntl is None:
        yield
        return
    build_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(build_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        previous = _acquire(fcntl, fd, build_dir, timeout_s)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _remove_stale_torch_lock(build_dir, previous)
        yield
    finally:
        os.close(fd)  # releases the flock


def _acquire(fcntl: ModuleType, fd: int, build_dir: Path, timeout_s: float) -> int | None:
    """Take the flock, waiting up to ``timeout_s``; returns the pid the file names (the
    last owner, or the one waited for)."""
    flock, ex, nb = fcntl.flock, fcntl.LOCK_EX, fcntl.LOCK_NB
    deadline = time.monotonic() + timeout_s
    told = False
    while True:
        try:
            flock(fd, ex | nb)
            return _owner(fd)
        except BlockingIOError:
            pass
        owner = _owner(fd)
        if not told:
            told = True
            logger.warning("waiting for process %s, building CPU kernels in %s",
                           owner if owner is not None else "(unknown)", build_dir)
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the CPU kernel build in {build_dir} has been held by process {owner} for "
                f"more than {timeout_s:.0f} s")
        time.sleep(0.1)


def _owner(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode().strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None


def _remove_stale_torch_lock(build_dir: Path, previous: int | None) -> None:
    path = build_dir / TORCH_LOCK_NAME
    if path.exists():
        logger.warning("removing a stale build lock left by a killed build (last owner: "
                       "process %s): %s", previous if previous is not None else "unknown", path)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
