"""``--engine-core-process``: the engine core in a process of its own, behind the same
server. Its outputs equal the in-process engine's; aborts free KV across the process
boundary; one /metrics shows both processes' figures; structured outputs work; a dead
engine process fails in-flight and new requests cleanly and turns /health unhealthy;
a failed start raises the engine's error. No test waits on a live engine process
without a timeout: the kill comes first, then the reads."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from iterserve.engine.async_llm import AsyncLLM
from iterserve.engine.builder import engine_config_from_args
from iterserve.engine.core_proc_client import EngineStartupError
from iterserve.metrics import METRIC_NAMES
from tests.server.helpers import MODEL, ServerThread
from tests.server.test_api import PROMPT, sse_events
from tests.server.test_errors import assert_error
from tests.server.test_speculative import SPEC, TRAINED, _complete, needs_trained

pytestmark = pytest.mark.timeout(180)

PROMPTS = [PROMPT, "Hello, my name is", "def main():\n    ", "1 2 3 4"]


def greedy(prompt: str = PROMPT, max_tokens: int = 12, **kw) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, **kw}


@pytest.fixture(scope="module")
def proc_server(model_path):
    with ServerThread(model_path, enable_test_hooks=True, engine_core_process=True) as s:
        yield s


def _slow_steps(server, seconds: float = 0.02) -> None:
    """Every step sleeps ``seconds`` in the engine process: requests stay in flight."""
    r = httpx.post(server.base_url + "/_test/fault",
                   json={"kind": "hang", "count": 100_000, "seconds": seconds}, timeout=5)
    assert r.status_code == 200


def _no_fault(server) -> None:
    httpx.post(server.base_url + "/_test/fault", json={"kind": "none"}, timeout=5)


def _wait(cond, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_greedy_outputs_equal_the_thread_engine(server, proc_server):
    texts: list[str] = []
    for body in [greedy(p, 16) for p in PROMPTS] + [
            greedy(PROMPT, 8, n=2, temperature=0.8, seed=7),
            greedy(PROMPT, 6, logprobs=2, prompt_logprobs=1, return_token_ids=True),
            greedy(PROMPT, 30, stop=[" "], ignore_eos=False)]:
        got = []
        for s in (server, proc_server):
            r = httpx.post(s.base_url + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 200, r.text
            out = r.json()
            got.append((out["choices"], out["usage"]["prompt_tokens"],
                        out["usage"]["completion_tokens"]))
        assert got[0] == got[1], body
        texts += [c["text"] for c in got[0][0]]
    assert sum(map(bool, texts)) >= 5  # (not empty outputs compared with each other)
    # Streaming and chat through the process client: the same text as non-streamed.
    body = greedy(PROMPTS[1], 16)
    whole = httpx.post(proc_server.base_url + "/v1/completions", json=body, timeout=30)
    streamed = httpx.post(proc_server.base_url + "/v1/completions",
                          json={**body, "stream": True}, timeout=30)
    events = sse_events(streamed.text)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == \
        whole.json()["choices"][0]["text"]
    proc_server.wait_idle()


def test_abort_across_the_boundary_frees_kv(proc_server):
    s = proc_server
    url = s.base_url + "/v1/completions"
    _slow_steps(s)
    try:
        with httpx.Client(timeout=30) as c, c.stream(
                "POST", url, json=greedy(PROMPT, 200, stream=True)) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            assert s.metric("kv_cache_usage_perc") > 0
            assert s.metric("num_requests_running") == 1
        # The client left mid-stream: the server aborts, the engine process frees the
        # blocks and reports it with its stats.
        _wait(lambda: s.metric("kv_cache_usage_perc") == 0
              and s.metric("num_requests_running") == 0, what="KV freed")
    finally:
        _no_fault(s)
    state = httpx.get(s.base_url + "/_test/state", timeout=5).json()
    assert state["num_free_blocks"] == state["num_blocks"] > 0
    assert state["num_unfinished_requests"] == 0 and state["num_leak_reports"] == 0
    assert s.metric("request_success_total", finished_reason="abort") >= 1
    s.wait_idle()


def test_metrics_from_both_processes_in_one_scrape(proc_server):
    s = proc_server
    before = s.metrics()
    r = httpx.post(s.base_url + "/v1/completions", json=greedy(PROMPT, 5), timeout=30)
    assert r.status_code == 200
    s.wait_idle()
    after = s.metrics()
    p = s.metrics_prefix

    def grew(name: str) -> float:
        return after.get(f"{p}:{name}", 0) - before.get(f"{p}:{name}", 0)

    # The engine process's figures (its step stats, sent with each step's outputs) ...
    assert grew("iteration_tokens_total_count") >= 5
    assert grew("prefix_cache_queries_total") > 0
    assert after[f"{p}:num_requests_running"] == 0 and after[f"{p}:kv_cache_usage_perc"] == 0
    assert after[f"{p}:engine_healthy"] == 1
    # ... beside the server process's own (timings, tokens, finishes).
    assert grew("time_to_first_token_seconds_count") == 1
    assert grew("generation_tokens_total") == 5
    assert grew("request_success_total{finished_reason=length}") == 1
    assert any(k.startswith(f"{p}:cache_config_info") for k in after)
    for name in METRIC_NAMES:  # the one metrics definition, whole, in one scrape
        assert any(k.startswith(f"{p}:{name}") for k in after), name


def test_step_timeout_in_the_engine_process(proc_server):
    """The step guard runs in the engine process: a hung step fails its request (500),
    and the engine goes on serving."""
    s = proc_server
    url = s.base_url + "/v1/completions"
    r = httpx.post(s.base_url + "/_test/fault", timeout=5, json={
        "kind": "hang", "count": 1, "seconds": 3.0, "step_timeout_s": 0.3})
    assert r.status_code == 200
    try:
        err = assert_error(httpx.post(url, json=greedy(PROMPT, 4), timeout=30), 500)
        assert err["code"] == "engine_step_failed" and "step timeout" in err["message"]
    finally:
        httpx.post(s.base_url + "/_test/fault", timeout=5,
                   json={"kind": "none", "step_timeout_s": None})
    time.sleep(3.0)  # the abandoned step's sleep ends; its worker is gone
    r = httpx.post(url, json=greedy(PROMPT, 4), timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    s.wait_idle()


def test_slo_refusal_crosses_the_boundary_as_429(model_path):
    with ServerThread(model_path, engine_core_process=True, engine_args={
            "scheduling_policy": "slo", "slo_admission": True}) as s:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "ttft_slo_ms": 1e-6}
        err = assert_error(httpx.post(s.base_url + "/v1/completions", json=body, timeout=60),
                           429, "ttft_slo_ms")
        assert "ttft_slo_ms" in err["message"]
        ok = {**body, "ttft_slo_ms": 60_000}
        assert httpx.post(s.base_url + "/v1/completions", json=ok, timeout=60).status_code == 200
        s.wait_idle()


def test_structured_outputs_over_the_boundary(proc_server):
    url = proc_server.base_url + "/v1/chat/completions"
    choices = ["yes", "no", "maybe"]
    for body in (
        {"structured_outputs": {"choice": choices}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
            "type": "object", "properties": {"a": {"type": "integer"}},
            "required": ["a"], "additionalProperties": False}}}},
    ):
        r = httpx.post(url, timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "pick"}],
            "max_tokens": 40, "temperature": 0.0, **body})
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["message"]["content"]
        if "structured_outputs" in body:
            assert text in choices
        else:
            import json

            out = json.loads(text)
            assert set(out) == {"a"} and isinstance(out["a"], int)
    # A bad grammar is refused by the server before the engine sees it.
    r = httpx.post(url, timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}],
        "structured_outputs": {"regex": "(unclosed"}})
    assert_error(r, 400)
    proc_server.wait_idle()


def test_engine_process_killed_mid_stream(model_path):
    with ServerThread(model_path, enable_test_hooks=True, engine_core_process=True) as s:
        url = s.base_url + "/v1/completions"
        pid = s.engine.core_client.proc.pid
        _slow_steps(s)
        with httpx.Client(timeout=30) as c, c.stream(
                "POST", url, json=greedy(PROMPT, 200, stream=True)) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            rest = "\n".join(lines)
        assert time.monotonic() - t0 < 10, "the stream hung after the engine died"
        events = sse_events(first + "\n" + rest)
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "engine_unavailable", events[-2]
        assert "exit code -9" in events[-2]["error"]["message"]
        err = assert_error(httpx.get(s.base_url + "/health", timeout=5), 503)
        assert err["code"] == "engine_unavailable"
        t0 = time.monotonic()
        assert_error(httpx.post(url, json=greedy(), timeout=5), 503)
        assert time.monotonic() - t0 < 2
        assert s.metric("engine_healthy") == 0
        assert s.engine.num_unfinished_requests == 0


def test_server_exit_leaves_no_engine_process(model_path):
    with ServerThread(model_path, engine_core_process=True) as s:
        proc = s.engine.core_client.proc
        assert proc.is_alive()
    # __exit__ shut the server down: the engine process is gone with it.
    assert not proc.is_alive() and proc.exitcode is not None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state, ppid, ...); None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = _stat(int(d))
            if st is not None and int(st[1]) == pid:
                out.append(int(d))
    return out


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except (FileNotFoundError, ProcessLookupError):
        return b""


def _gone(pid: int) -> bool:
    st = _stat(pid)
    return st is None or st[0] in ("Z", "X")  # a zombie has exited


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_serve_cli_engine_dies_with_its_server(model_path):
    """``iterserve serve --engine-core-process`` as a user starts it: it serves; when the
    server process is SIGKILLed (no shutdown runs), the engine process exits too."""
    port = _free_port()
    cmd = [sys.executable, "-m", "iterserve.entrypoints.cli", "serve", str(model_path),
           "--engine-core-process", "--port", str(port), "--device", "cpu",
           "--served-model-name", MODEL, "--num-gpu-blocks-override", "64",
           "--max-model-len", "256", "--max-num-seqs", "4", "--log-level", "warning"]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    children: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, f"the server exited with {server.returncode}"
            assert time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=greedy(), timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
        children = _children(server.pid)  # the engine (and multiprocessing's tracker)
        engines = [c for c in children if b"spawn_main" in _cmdline(c)]
        assert len(engines) == 1, [_cmdline(c) for c in children]
        server.kill()
        server.wait(10)
        _wait(lambda: all(map(_gone, children)), timeout=15,
              what="the engine process to exit with its server")
    finally:
        server.kill()
        for c in children:
            if not _gone(c):
                os.kill(c, signal.SIGKILL)


def test_startup_failure_surfaces_the_engine_error(tmp_path):
    missing = tmp_path / "no-such-model"
    t0 = time.monotonic()
    with pytest.raises(EngineStartupError) as e:
        AsyncLLM.from_engine_config(
            engine_config_from_args(str(missing), device="cpu"), engine_core_process=True)
    assert time.monotonic() - t0 < 120
    assert "failed to start" in str(e.value) and "no-such-model" in str(e.value)


def test_serve_cli_reports_the_engine_error(tmp_path):
    missing = tmp_path / "no-such-model"
    cmd = [sys.executable, "-m", "iterserve.entrypoints.cli", "serve", str(missing),
           "--engine-core-process", "--port", str(_free_port()), "--device", "cpu"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("iterserve: error: the engine core failed to start")
    assert "no-such-model" in last


@needs_trained
def test_speculative_decoding_over_the_boundary():
    """Several tokens per request per step (n-gram drafts accepted) cross as a whole,
    and the engine's spec_decode counters reach the server's /metrics."""
    args = {"dtype": "float32", "backend": "torch"}
    with ServerThread(TRAINED, engine_core_process=True,
                      engine_args={**args, "speculative_config": SPEC}) as spec, \
            ServerThread(TRAINED, engine_args=args) as plain:
        want = _complete(plain.base_url)
        assert want
        assert _complete(spec.base_url) == want
        assert _complete(spec.base_url, stream=True) == want
        m = spec.metrics()
        accepted = m["iterserve:spec_decode_num_accepted_tokens_total"]
        assert m["iterserve:spec_decode_num_drafts_total"] > 0 and accepted > 0
        per_pos = sum(v for k, v in m.items() if k.startswith(
            "iterserve:spec_decode_num_accepted_tokens_per_pos_total"))
        assert per_pos == accepted
        spec.wait_idle()
