"""The README's first command as a fixture: ``iterserve serve`` with no model (the built-in
default model), on a free port, in a subprocess shared by the tests that need a real server.

The server writes to a file, never to a pipe (a pipe nobody drains blocks a chatty
server); on a failure it is killed first and its log read after.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

START_TIMEOUT_S = 300  # a first start builds the model and the C++ kernels


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def iterserve_command() -> list[str]:
    """The console script the README runs (``.venv/bin/iterserve``), beside this Python;
    ``python -m`` where the package is on the path but not installed as a script."""
    script = Path(sys.executable).parent / "iterserve"
    return [str(script)] if script.is_file() else [sys.executable, "-m",
                                                   "iterserve.entrypoints.cli"]


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout_s: float = 20) -> None:
    """Signal ``proc`` and wait for it, killing it if it outlives ``timeout_s``."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="session")
def readme_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``iterserve serve --port N``: the README's command on a free port; yields the URL."""
    port = free_port()
    log = tmp_path_factory.mktemp("readme-server") / "server.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen([*iterserve_command(), "serve", "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                stop(proc, signal.SIGKILL)
                pytest.fail(f"iterserve serve not healthy (exit {proc.returncode}):\n"
                            f"{log.read_text()[-5000:]}")
            time.sleep(0.5)
        yield base
    finally:
        stop(proc)
