"""The soak: a real ``iterserve serve`` subprocess under a bounded, self-stopping load at
over capacity, with a mix of good, bad, impatient and vanishing clients, then an audit.

Every request carries an ``X-Request-Id`` the client chose; the server (run with
``--enable-test-hooks``) keeps a log of every engine request that ended (parent id,
child index, finish reason), read from ``GET /_test/state``. The audit joins the two:

- accepted = completed + aborted + errored, each child exactly once, by id;
- rejected requests got 400/401/404/429 with an OpenAI error body and never reached
  the engine;
- lost = 0: no accepted request without an end, no client left hanging;
- afterwards nothing running, waiting, admitted or streaming; every KV block free;
- ``/metrics`` counters equal the counts in the log (and the client's 429s);
- ``/health`` answered within 1 s throughout;
- server RSS did not grow between the first and the second half;
- greedy probes served under load equal the same prompts served one at a time.

Used by benchmarks/soak.py (by hand, any duration) and tests/soak/test_soak.py
(short in CI, long with ``-m slow``). This module: the configuration and the server
subprocess; ``clients``: the load; ``audit``: the run and its checks.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from iterserve.metrics import parse_metrics

API_KEY = "soak-key"
MODEL = "soak-model"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ERROR_KEYS = {"message", "type", "param", "code"}
_ENGINE_ID = re.compile(r"^(.*)-[0-9a-f]{32}$")


@dataclass(slots=True)
class SoakConfig:
    duration_s: float = 20.0
    calibrate_s: float = 3.0
    overload: float = 3.0  # offered rate / the rate the server sustains
    max_in_flight: int = 96  # client tasks at once (bounds the client, not the server)
    seed: int = 0
    # The server: small KV pool so preemption happens, admission cap so overload is refused.
    num_gpu_blocks: int = 24
    block_size: int = 16
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 128
    max_model_len: int = 256
    max_num_queued_requests: int = 24
    max_tokens_limit: int = 64
    max_request_body_bytes: int = 64 * 1024
    step_timeout_s: float = 1.0
    # Faults injected during the run: one failing step at each of these fractions, one
    # hung step (past the step timeout) at each of those.
    raise_at: tuple[float, ...] = (0.3, 0.7)
    hang_at: tuple[float, ...] = (0.5,)
    rss_sample_s: float = 0.25
    health_poll_s: float = 0.2
    client_timeout_s: float = 60.0  # a request still unanswered after this is "lost"


# --- the server ------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``iterserve serve`` in a subprocess (so its RSS is its own)."""

    def __init__(self, model_path: Path, cfg: SoakConfig, log_path: Path) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.cmd = [
            sys.executable, "-m", "iterserve.entrypoints.cli", "serve",
            "--model", str(model_path), "--served-model-name", MODEL,
            "--port", str(self.port), "--device", "cpu", "--dtype", "float32",
            "--num-gpu-blocks-override", str(cfg.num_gpu_blocks),
            "--block-size", str(cfg.block_size),
            "--max-num-seqs", str(cfg.max_num_seqs),
            "--max-num-batched-tokens", str(cfg.max_num_batched_tokens),
            "--max-model-len", str(cfg.max_model_len),
            "--scheduling-policy", "priority",
            "--max-num-queued-requests", str(cfg.max_num_queued_requests),
            "--max-tokens-limit", str(cfg.max_tokens_limit),
            "--max-request-body-bytes", str(cfg.max_request_body_bytes),
            "--log-stats-interval", "0", "--log-level", "warning",
            "--enable-test-hooks",
        ]
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                   ITERSERVE_API_KEY=API_KEY)
        self._log = open(self.log_path, "w")  # closed in __exit__
        self.proc = subprocess.Popen(self.cmd, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(self.base_url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"server did not start:\n{self.log_path.read_text()}")
            time.sleep(0.2)

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()

    def rss_mib(self) -> float:
        assert self.proc is not None
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return 0.0


def read_metrics(base_url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(base_url + "/metrics", headers=AUTH, timeout=10).text)


def read_state(base_url: str, drain: bool = False) -> dict[str, Any]:
    r = httpx.get(base_url + "/_test/state", params={"drain": drain}, headers=AUTH, timeout=10)
    r.raise_for_status()
    return r.json()


def wait_idle(base_url: str, timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        st = read_state(base_url)
        m = read_metrics(base_url)
        busy = (st["num_streams"], st["num_unfinished_requests"], st["num_admitted_requests"],
                m["iterserve:num_requests_running"], m["iterserve:num_requests_waiting"])
        if busy == (0, 0, 0, 0, 0) and st["num_free_blocks"] == st["num_blocks"]:
            return st
        if time.monotonic() > deadline:
            return st
        time.sleep(0.1)


