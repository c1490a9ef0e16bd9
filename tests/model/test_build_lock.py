"""A kernel build killed mid-way never makes a later start hang: the build folder's lock
is released by the kernel when its owner dies, a torch lock file it left behind is
removed, and a start that cannot get the lock in time runs the torch kernels.

The loading checks run in a subprocess (a process loads the kernels once) on a copy of
this session's build in a temporary ``TORCH_EXTENSIONS_DIR``: up to date, so loading it
costs no compile. Every subprocess is bounded in time and killed before it is read."""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from iterserve.model import build_lock, cpu_ops

needs_kernels = pytest.mark.skipif(not cpu_ops.available(),
                                   reason="C++ CPU kernels not built here")

_LOAD = textwrap.dedent("""
    import logging, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stdout)
    from iterserve.model import cpu_ops
    print("AVAILABLE", cpu_ops.available(), cpu_ops.unavailable_reason, flush=True)
""")


def _copy_build(tmp_path: Path) -> tuple[Path, Path]:
    """This session's build, copied into a fresh extensions root: (root, build folder)."""
    name, src = cpu_ops.build_location("iterserve_cpu_ops", cpu_ops._SOURCES)
    root = tmp_path / "ext"
    dst = root / name  # where the child, given TORCH_EXTENSIONS_DIR=root, looks
    shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns("*.lock", "lock"))
    return root, dst


def _load_in_subprocess(root: Path, tmp_path: Path, timeout_s: float = 120,
                        **env: str) -> str:
    """Load the kernels in a fresh process; its output (the process is killed first if it
    outlives ``timeout_s``, which fails the test)."""
    log = tmp_path / "load.log"
    src = str(Path(cpu_ops.__file__).resolve().parents[2])
    child_env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(root), "OMP_NUM_THREADS": "1",
                 "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]), **env}
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-c", _LOAD], stdout=f,
                                stderr=subprocess.STDOUT, env=child_env,
                                start_new_session=True)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the loader and any compiler it started
        proc.wait(10)
        pytest.fail(f"loading the kernels hung for {timeout_s} s:\n{log.read_text()[-3000:]}")
    return log.read_text()


@needs_kernels
def test_a_stale_torch_lock_left_by_a_killed_build_is_taken_over(tmp_path):
    root, build = _copy_build(tmp_path)
    # What a start killed mid-build leaves: torch's lock file, and ours naming a pid
    # that has gone (its flock went with it).
    (build / build_lock.TORCH_LOCK_NAME).write_text("")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(30)
    (build / build_lock.LOCK_NAME).write_text(f"{dead.pid}\n")
    out = _load_in_subprocess(root, tmp_path)
    assert "AVAILABLE True" in out, out
    assert "removing a stale build lock" in out and str(dead.pid) in out, out
    assert not (build / build_lock.TORCH_LOCK_NAME).exists()


@needs_kernels
def test_a_start_that_cannot_get_the_lock_falls_back_to_torch(tmp_path):
    """A live process holding the lock past the timeout: the start runs the torch kernels
    with a warning naming the holder, it does not wait for ever."""
    root, build = _copy_build(tmp_path)
    fd = os.open(build / build_lock.LOCK_NAME, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, f"{os.getpid()}\n".encode())
        out = _load_in_subprocess(root, tmp_path, ITERSERVE_BUILD_LOCK_TIMEOUT="1")
    finally:
        os.close(fd)
    assert f"waiting for process {os.getpid()}" in out, out
    assert "AVAILABLE False" in out and f"held by process {os.getpid()}" in out, out
    assert "using torch kernels" in out, out


def test_lock_is_released_when_its_owner_is_killed(tmp_path):
    """The flock itself: a process killed while holding it (as Ctrl-C in a build) leaves
    a lock the next owner takes at once."""
    code = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from iterserve.model.build_lock import build_lock
        with build_lock(Path({str(tmp_path)!r})):
            print("HELD", flush=True)
            time.sleep(600)
    """)
    src = str(Path(build_lock.__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "holder.log"
    with open(out, "w") as f:
        holder = subprocess.Popen([sys.executable, "-c", code], stdout=f,
                                  stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 60
        while "HELD" not in out.read_text():
            assert holder.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.05)
        with (pytest.raises(TimeoutError, match=f"held by process {holder.pid}"),
              build_lock.build_lock(tmp_path, timeout_s=0.3)):
            pass
    finally:
        holder.kill()
        holder.wait(10)
    with build_lock.build_lock(tmp_path, timeout_s=5):
        assert (tmp_path / build_lock.LOCK_NAME).read_text().strip() == str(os.getpid())
