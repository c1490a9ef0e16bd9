"""`iterserve serve` as a user runs it: a subprocess, the flags, a request, Ctrl-C."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from iterserve.entrypoints.cli import build_parser
from iterserve.metrics import Metrics, SchedulerSnapshot


def test_serve_flags_parse():
    args = build_parser().parse_args([
        "serve", "--model", "m", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
        "--block-size", "8", "--num-gpu-blocks-override", "32", "--kv-cache-memory", "1GiB",
        "--no-enable-prefix-caching", "--scheduling-policy", "priority",
        "--preemption-mode", "swap", "--swap-space", "16", "--max-model-len", "128",
        "--dtype", "float32", "--seed", "3", "--max-num-queued-requests", "10",
        "--max-num-queued-tokens", "1000", "--api-key", "k", "--metrics-prefix", "vllm",
    ])
    assert args.host == "127.0.0.1" and args.port == 8000
    assert args.kv_cache_memory == 2**30 and args.enable_prefix_caching is False
    from iterserve.entrypoints.engine_args import engine_config_from_cli

    cfg = engine_config_from_cli(args)
    assert cfg.cache.num_gpu_blocks == 32 and cfg.cache.swap_space == 16
    assert cfg.scheduler.scheduling_policy == "priority" and cfg.scheduler.max_model_len == 128


def test_parser_flags_name_their_choices(capsys):
    from iterserve.entrypoints.cli_serve import server_config_from_cli

    args = build_parser().parse_args([
        "serve", "--reasoning-parser", "qwen3", "--tool-call-parser", "pythonic",
        "--enable-auto-tool-choice"])
    cfg = server_config_from_cli(args, ["m"])
    assert (cfg.reasoning_parser, cfg.tool_call_parser) == ("qwen3", "pythonic")
    for flag, choices in (("--reasoning-parser", ["deepseek_r1", "qwen3"]),
                          ("--tool-call-parser", ["hermes", "llama3_json", "phi4_mini_json",
                                                  "pythonic"])):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", flag, "nope"])
        err = capsys.readouterr().err
        assert "invalid choice: 'nope'" in err and all(c in err for c in choices), err


def test_log_line():
    m = Metrics("x")
    assert m.log_line() is None  # idle: nothing to say
    m.observe_tokens(100, 10)
    m.observe_step(SchedulerSnapshot(num_running=2, num_waiting=1, kv_cache_usage=0.25,
                                     num_preemptions=1), 12)
    line = m.log_line()
    assert "Running: 2 reqs, Waiting: 1 reqs, KV cache usage: 25.0%" in line
    assert "Preemptions: 1" in line and "generation throughput" in line


def test_iterserve_serve_subprocess(model_path, tmp_path):
    """vLLM's launch line: the model positional, TLS, a root path, two API keys, request
    logging, log levels in capitals, a human-readable --max-model-len."""
    if shutil.which("openssl") is None:
        pytest.skip("needs openssl for a self-signed certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost"],
                   check=True, capture_output=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "iterserve.entrypoints.cli", "serve", str(model_path),
           "--port", str(port), "--num-gpu-blocks-override", "32", "--max-model-len", "0.128k",
           "--device", "cpu", "--log-level", "INFO", "--uvicorn-log-level", "WARNING",
           "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--root-path", "/api",
           "--api-key", "k1", "k2", "--enable-log-requests", "--max-log-len", "3",
           "--trust-remote-code", "-tp", "1", "-dp", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # The server writes to a file, never to a pipe: a pipe nobody drains blocks a chatty
    # server, and reading one from a live server blocks the test. On a failure the
    # server is killed first, then its log read.
    log = tmp_path / "server.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, text=True)
    try:
        base = f"https://127.0.0.1:{port}"
        http = httpx.Client(verify=False, timeout=30)
        deadline = time.monotonic() + 120
        while True:
            try:
                if http.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                _stop(proc, signal.SIGKILL)
                pytest.fail(f"iterserve serve not healthy (exit {proc.returncode}):\n"
                            f"{log.read_text()[-5000:]}")
            time.sleep(0.2)
        assert http.get(base + "/v1/models").status_code == 401
        for k in ("k1", "k2"):
            auth = {"Authorization": f"Bearer {k}"}
            card = http.get(base + "/v1/models", headers=auth).json()["data"][0]
            assert card["id"] == str(model_path) and card["max_model_len"] == 128
        # Behind a proxy that strips /api: the app knows its prefix (OpenAPI's servers).
        assert http.get(base + "/openapi.json", headers=auth).json()["servers"] == [
            {"url": "/api"}]
        r = http.post(base + "/v1/completions", headers=auth,
                      json={"model": card["id"], "prompt": "Hello there, how are you",
                            "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    finally:
        _stop(proc, signal.SIGINT)
    out = log.read_text()
    assert proc.returncode == 0, out
    assert "--trust-remote-code: iterserve runs no code" in out
    # --enable-log-requests, the prompt's token ids cut at --max-log-len.
    line = next(x for x in out.splitlines() if "Received request" in x)
    ids = line.split("prompt_token_ids: ")[1]
    assert len(ids.strip("[]").split(",")) == 3, line


def _stop(proc: subprocess.Popen, sig: int, timeout_s: float = 20) -> None:
    """Signal ``proc`` and wait for it to end, killing it if it outlives ``timeout_s``;
    it never blocks longer (the caller reads the log file afterwards)."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_model_that_cannot_load_is_one_error_line(tmp_path, capsys):
    """A checkpoint of an unsupported architecture ends `iterserve generate` with the
    loader's message and status 2, not a traceback."""
    import json

    from iterserve.entrypoints.cli import main

    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["MambaForCausalLM"], "model_type": "mamba"}))
    rc = main(["generate", "--model", str(tmp_path), "--prompt", "hi", "--max-tokens", "2"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("iterserve: error: unsupported model architecture ['MambaForCausalLM']")
    assert "Traceback" not in err
