"""bench serve against iterserve's own server with its built-in tiny model.

Starts ``iterserve serve`` in a subprocess on a free port (CPU, no downloads),
sends a short run, and checks zero failures and a result file that reloads.
Skipped until the server exists; marked slow (the model is built and loaded).
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from iterserve.bench.results import load_result, records_of
from iterserve.entrypoints.cli import main

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("iterserve.entrypoints.cli_serve") is None,
        reason="iterserve serve not built yet",
    ),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def iterserve_server(tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "iterserve.entrypoints.cli", "serve", "--host", "127.0.0.1",
             "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while True:
            if proc.poll() is not None:
                pytest.fail(f"iterserve serve exited with {proc.returncode}:\n{log.read_text()}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                pytest.fail(f"iterserve serve not healthy after 180 s:\n{log.read_text()}")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_short_run_against_iterserve(iterserve_server, tmp_path, endpoint):
    name = "run.json"
    argv = [
        "bench", "serve", "--base-url", iterserve_server, "--endpoint", endpoint,
        "--dataset-name", "random", "--num-prompts", "8", "--random-input-len", "24",
        "--random-output-len", "8", "--random-range-ratio", "0.5", "--tokenizer", "byte",
        "--ignore-eos", "--request-rate", "20", "--max-concurrency", "4",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(tmp_path), "--result-filename", name,
        "--disable-tqdm",
    ]
    assert main(argv) == 0
    result = load_result(tmp_path / name)
    assert result["completed"] == 8 and result["failed"] == 0, result["errors"]
    recs = records_of(result)
    # ignore_eos: every request generates exactly the tokens it asked for.
    assert all(r.output_len == r.expected_output_len for r in recs)
    assert all(r.ttft > 0 and r.e2el >= r.ttft for r in recs)
    assert result["total_output_tokens"] == sum(r.expected_output_len for r in recs)
    assert result["mean_ttft_ms"] > 0 and result["p99_e2el_ms"] > 0
