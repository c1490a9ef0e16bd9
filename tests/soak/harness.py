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

Used by tests/soak/test_soak.py (short in CI, long with ``-m slow``) and by
benchmarks/soak.py (by hand, any duration).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.server.helpers import parse_metrics

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


# --- the clients ---------------------------------------------------------------------


@dataclass(slots=True)
class Outcome:
    """What one client saw of one request."""

    rid: str
    kind: str  # the request's recipe
    num_children: int = 0  # engine requests it makes if accepted (n x prompts)
    status: int | None = None  # HTTP status (None: no response head)
    result: str = ""  # completed | rejected | errored | cancelled | broken | lost
    finish_reasons: dict[int, str] = field(default_factory=dict)
    texts: dict[int, str] = field(default_factory=dict)
    error_code: Any = None
    problem: str = ""  # why an outcome is wrong (empty when fine)
    greedy_prompt: str | None = None
    t_start: float = 0.0


class Workload:
    """Request recipes: a weighted mix of good, bad and impatient requests."""

    def __init__(self, cfg: SoakConfig, seed: int) -> None:
        self.cfg = cfg
        self.rng = random.Random(seed)
        # Words the test tokenizer holds whole (about a token each).
        words = ("the quick brown fox jumps over lazy dog engine cache block step model text "
                 "requests continuous batching pages small happy code every once main").split()
        prng = random.Random(1234)
        # Shared prefixes (~50 tokens: three full blocks, so the prefix cache hits).
        self.prefixes = [" ".join(prng.choice(words) for _ in range(48)) for _ in range(3)]
        self.words = words
        self.greedy_prompts = [f"{self.prefixes[i % 3]} probe {i}: " +
                               " ".join(prng.choice(words) for _ in range(6)) for i in range(6)]

    def prompt(self) -> str:
        rng = self.rng
        tail = " ".join(rng.choice(self.words) for _ in range(rng.randint(2, 20)))
        if rng.random() < 0.6:
            return f"{rng.choice(self.prefixes)} {tail}"
        return tail

    def next(self, i: int) -> tuple[str, dict[str, Any]]:
        """(recipe name, request spec) for the i-th request."""
        rng = self.rng
        x = rng.random()
        if x < 0.08:
            return "greedy", {"greedy": rng.randrange(len(self.greedy_prompts)),
                              "stream": rng.random() < 0.5, "chat": False}
        if x < 0.30:
            return "invalid", {"invalid": rng.choice(INVALID_KINDS)}
        spec: dict[str, Any] = {
            "chat": rng.random() < 0.4,
            "stream": rng.random() < 0.5,
            "n": rng.choice([1, 1, 1, 2, 3]),
            "max_tokens": rng.randint(4, 48),
            "priority": rng.choice([-1, 0, 0, 1, 2]),
            "tenant": rng.choice(["acme", "globex", "initech"]),
            "ignore_eos": rng.random() < 0.5,
            "temperature": rng.choice([0.0, 0.7, 1.0]),
            "prompt": self.prompt(),
        }
        y = rng.random()
        if y < 0.15:
            spec["disconnect_after"] = rng.randint(0, 6)  # chunks read, then drop (stream)
            spec["stream"] = True
            return "disconnect", spec
        if y < 0.25:
            spec["timeout_s"] = rng.uniform(0.05, 1.5)  # the client gives up
            return "timeout", spec
        return "valid", spec


INVALID_KINDS = [
    "bad_type", "negative_max_tokens", "oversize_prompt", "malformed_json", "huge_body",
    "wrong_api_key", "n_too_big", "max_tokens_over_limit", "too_many_stops",
    "logprobs_too_big", "unknown_model", "bad_request_id",
]


def _body(spec: dict[str, Any], workload: Workload) -> dict[str, Any]:
    if "greedy" in spec:
        return {"model": MODEL, "prompt": workload.greedy_prompts[spec["greedy"]],
                "max_tokens": 16, "temperature": 0.0, "ignore_eos": True,
                "stream": spec["stream"]}
    body: dict[str, Any] = {
        "model": MODEL, "n": spec["n"], "max_tokens": spec["max_tokens"],
        "priority": spec["priority"], "ignore_eos": spec["ignore_eos"],
        "temperature": spec["temperature"], "stream": spec["stream"],
    }
    if spec["temperature"] == 0.0 and spec["n"] > 1:
        body["temperature"] = 0.8  # n greedy samples are all alike; sample instead
    if spec["chat"]:
        body["messages"] = [{"role": "user", "content": spec["prompt"]}]
        body["user"] = spec["tenant"]
    else:
        body["prompt"] = spec["prompt"]
    if spec["stream"] and random.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    return body


def _invalid(kind: str, cfg: SoakConfig) -> tuple[dict[str, str], bytes, set[int]]:
    """(headers, body bytes, acceptable statuses) of an invalid request."""
    ok = {"model": MODEL, "prompt": "hello there", "max_tokens": 4}
    headers = {"content-type": "application/json", **AUTH}
    if kind == "bad_type":
        b = {**ok, "temperature": "hot"}
    elif kind == "negative_max_tokens":
        b = {**ok, "max_tokens": -3}
    elif kind == "oversize_prompt":
        # Over the context length; admission (429) comes before tokenization, so at
        # capacity the refusal may be a 429 instead.
        b = {**ok, "prompt": "the " * (cfg.max_model_len * 2)}
        return headers, json.dumps(b).encode(), {400, 429}
    elif kind == "malformed_json":
        return headers, b'{"model": "soak-model", "prompt": "x", ', {400}
    elif kind == "huge_body":
        b = {**ok, "prompt": "x" * (cfg.max_request_body_bytes + 1024)}
    elif kind == "wrong_api_key":
        return ({**headers, "Authorization": "Bearer nope"}, json.dumps(ok).encode(), {401})
    elif kind == "n_too_big":
        b = {**ok, "n": 1000}
    elif kind == "max_tokens_over_limit":
        b = {**ok, "max_tokens": cfg.max_tokens_limit + 1}
    elif kind == "too_many_stops":
        b = {**ok, "stop": [f"s{i}" for i in range(100)]}
    elif kind == "logprobs_too_big":
        b = {**ok, "logprobs": 1000}
    elif kind == "unknown_model":
        return headers, json.dumps({**ok, "model": "nope"}).encode(), {404}
    elif kind == "bad_request_id":
        return ({**headers, "X-Request-Id": "bad id with spaces"}, json.dumps(ok).encode(), {400})
    else:
        raise ValueError(kind)
    return headers, json.dumps(b).encode(), {400}


def _check_error_body(r_json: Any) -> str:
    if not isinstance(r_json, dict) or set(r_json.get("error", {})) != ERROR_KEYS:
        return f"not an OpenAI error body: {r_json!r}"[:200]
    return ""


class Driver:
    def __init__(self, server: ServerProcess, cfg: SoakConfig) -> None:
        self.server = server
        self.cfg = cfg
        self.url = server.base_url
        self.outcomes: list[Outcome] = []
        self.num_sent = 0

    async def one(self, client: httpx.AsyncClient, rid: str, kind: str, spec: dict[str, Any],
                  workload: Workload) -> Outcome:
        out = Outcome(rid, kind, t_start=time.monotonic())
        self.outcomes.append(out)
        try:
            async with asyncio.timeout(self.cfg.client_timeout_s):
                await self._run(client, out, spec, workload)
        except TimeoutError:
            if out.result != "cancelled":
                out.result = "lost"
                out.problem = f"no answer within {self.cfg.client_timeout_s} s"
        except Exception as e:  # a transport error, or a response the client cannot parse
            out.result = "broken"
            out.problem = f"{type(e).__name__}: {e}"
        if not out.result:
            out.result, out.problem = "broken", out.problem or "no outcome recorded"
        return out

    async def _run(self, client: httpx.AsyncClient, out: Outcome, spec: dict[str, Any],
                   workload: Workload) -> None:
        if "invalid" in spec:
            headers, content, statuses = _invalid(spec["invalid"], self.cfg)
            headers.setdefault("X-Request-Id", out.rid)
            path = "/v1/completions"
            r = await client.post(self.url + path, content=content, headers=headers)
            out.status = r.status_code
            out.result = "rejected"
            if r.status_code not in statuses:
                out.problem = f"{spec['invalid']}: got {r.status_code}, want {statuses}: {r.text}"
            else:
                out.problem = _check_error_body(r.json())
                out.error_code = r.json()["error"]["code"]
            return
        body = _body(spec, workload)
        out.num_children = body.get("n", 1)
        if "greedy" in spec:
            out.greedy_prompt = body["prompt"]
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        headers = {**AUTH, "X-Request-Id": out.rid}
        if "messages" not in body:
            headers["X-Tenant"] = spec.get("tenant", "default")
        timeout_s = spec.get("timeout_s")
        try:
            async with asyncio.timeout(timeout_s):
                if body["stream"]:
                    await self._stream(client, out, path, headers, body,
                                       spec.get("disconnect_after"))
                else:
                    r = await client.post(self.url + path, json=body, headers=headers)
                    self._non_stream(out, r, path)
        except TimeoutError:
            if timeout_s is None:
                raise
            out.result = "cancelled"

    def _non_stream(self, out: Outcome, r: httpx.Response, path: str) -> None:
        out.status = r.status_code
        data = r.json()
        if r.status_code == 200:
            if data["id"].split("-", 1)[1] != out.rid or r.headers.get("x-request-id") != out.rid:
                out.problem = f"id {data['id']} does not carry {out.rid}"
            for c in data["choices"]:
                out.finish_reasons[c["index"]] = c["finish_reason"]
                out.texts[c["index"]] = c["text"] if "text" in c else c["message"]["content"]
            out.result = "completed"
            if len(out.finish_reasons) != out.num_children:
                out.problem = f"{len(out.finish_reasons)} choices, want {out.num_children}"
            return
        out.problem = _check_error_body(data)
        out.error_code = data.get("error", {}).get("code")
        if r.status_code == 500 and out.error_code == "engine_step_failed":
            out.result = "errored"
        elif r.status_code in (400, 401, 404, 429):
            out.result = "rejected"
        else:
            out.result = "rejected"
            out.problem = out.problem or f"unexpected status {r.status_code}: {r.text[:200]}"

    async def _stream(self, client: httpx.AsyncClient, out: Outcome, path: str,
                      headers: dict[str, str], body: dict[str, Any],
                      disconnect_after: int | None) -> None:
        async with client.stream("POST", self.url + path, json=body, headers=headers) as r:
            out.status = r.status_code
            if r.status_code != 200:
                data = json.loads(await r.aread())
                out.problem = _check_error_body(data)
                out.error_code = data.get("error", {}).get("code")
                out.result = "rejected"
                if r.status_code not in (400, 401, 404, 429):
                    out.problem = out.problem or f"unexpected status {r.status_code}"
                return
            if r.headers.get("x-request-id") != out.rid:
                out.problem = f"X-Request-Id header {r.headers.get('x-request-id')!r}"
            num_events, done = 0, False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                num_events += 1
                if "error" in event:
                    out.error_code = event["error"].get("code")
                    out.problem = _check_error_body(event)
                    if out.error_code != "engine_step_failed":
                        out.problem = out.problem or f"unexpected error event {event}"
                    out.result = "errored"
                    continue
                if event["id"].split("-", 1)[1] != out.rid:
                    out.problem = f"id {event['id']} does not carry {out.rid}"
                for c in event["choices"]:
                    i = c["index"]
                    piece = c.get("text")
                    if piece is None:
                        piece = (c.get("delta") or {}).get("content") or ""
                    out.texts[i] = out.texts.get(i, "") + piece
                    if c.get("finish_reason"):
                        out.finish_reasons[i] = c["finish_reason"]
                if disconnect_after is not None and num_events > disconnect_after:
                    out.result = "cancelled"
                    return  # leaving the block closes the connection mid-stream
            if not done:
                out.problem = "stream ended without [DONE]"
            if out.result != "errored":
                out.result = "completed"
                if len(out.finish_reasons) != out.num_children:
                    out.problem = f"{len(out.finish_reasons)} finishes, want {out.num_children}"

    async def run_open_loop(self, rate: float, duration_s: float, workload: Workload,
                            rid_prefix: str, on_fraction: Any = None) -> float:
        """Poisson arrivals at ``rate``/s for ``duration_s``; waits for every request."""
        rng = random.Random(self.cfg.seed + 1)
        sem = asyncio.Semaphore(self.cfg.max_in_flight)
        limits = httpx.Limits(max_connections=self.cfg.max_in_flight + 8,
                              max_keepalive_connections=32)
        tasks: set[asyncio.Task] = set()
        async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
            t0 = time.monotonic()
            next_t = t0
            i = 0
            while True:
                now = time.monotonic()
                if now - t0 >= duration_s:
                    break
                if on_fraction is not None:
                    await on_fraction((now - t0) / duration_s)
                if now < next_t:
                    await asyncio.sleep(min(next_t - now, 0.05))
                    continue
                next_t += rng.expovariate(rate)
                await sem.acquire()
                kind, spec = workload.next(i)
                rid = f"{rid_prefix}-{i:06d}"
                i += 1
                task = asyncio.create_task(self.one(client, rid, kind, spec, workload))
                task.add_done_callback(lambda _: sem.release())
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            elapsed = time.monotonic() - t0
            self.num_sent += i
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
        return i / elapsed

    async def run_closed_loop(self, concurrency: int, duration_s: float,
                              workload: Workload, rid_prefix: str) -> float:
        """``concurrency`` clients back to back with valid requests: completed req/s."""
        counter = iter(range(10**9))
        t_end = time.monotonic() + duration_s
        done = [0]

        async def worker(client: httpx.AsyncClient) -> None:
            while time.monotonic() < t_end:
                kind, spec = workload.next(0)
                if kind != "valid":
                    continue
                out = await self.one(client, f"{rid_prefix}-{next(counter):06d}", kind, spec,
                                     workload)
                if out.result == "completed":
                    done[0] += 1

        t0 = time.monotonic()
        async with httpx.AsyncClient(timeout=httpx.Timeout(None)) as client:
            await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return done[0] / (time.monotonic() - t0)


def _poll_health(url: str, period_s: float, stop: threading.Event,
                 samples: list[float]) -> None:
    """GET /health every period; each sample is the latency (inf when not 200 in 1 s).

    On its own thread with a blocking client, so that the load generator's busy event
    loop does not add its own lag to what the server's /health takes."""
    with httpx.Client() as client:
        while not stop.is_set():
            t = time.monotonic()
            try:
                r = client.get(url + "/health", timeout=1.0)
                samples.append(time.monotonic() - t if r.status_code == 200 else float("inf"))
            except httpx.HTTPError:
                samples.append(float("inf"))
            stop.wait(period_s)


async def _drain_log(url: str, stop: asyncio.Event, finished: list[list]) -> None:
    """Move the server's finish log here every second, so that the (test-only) log does
    not grow the server's memory over a long soak."""
    async with httpx.AsyncClient(timeout=10) as client:
        while not stop.is_set():
            await asyncio.sleep(1.0)
            r = await client.get(url + "/_test/state", params={"drain": True}, headers=AUTH)
            finished.extend(r.json()["finished"])


async def _sample_rss(server: ServerProcess, period_s: float, stop: asyncio.Event,
                      samples: list[tuple[float, float]]) -> None:
    while not stop.is_set():
        samples.append((time.monotonic(), server.rss_mib()))
        await asyncio.sleep(period_s)


async def count_objects(url: str) -> dict[str, Any]:
    """The server's live Python objects (a leak shows as a type whose count grows)."""
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.get(url + "/_test/objects", headers=AUTH)
        return r.json()


# --- the run and its audit -----------------------------------------------------------


@dataclass(slots=True)
class SoakReport:
    duration_s: float
    sustained_rps: float
    offered_rps: float
    num_sent: int
    accepted: int
    completed: int
    aborted: int
    errored: int
    rejected: dict[int, int]
    cancelled_before_engine: int
    lost: int
    duplicates: int
    blocks_leaked: int
    num_blocks: int
    preemptions: float
    prefix_cache_hit_rate: float
    health_max_s: float
    health_failures: int
    rss_first_mib: float
    rss_second_mib: float
    greedy_checked: int
    greedy_mismatches: int
    problems: list[str]
    finish_counts: dict[str, int]
    metric_deltas: dict[str, float]
    rss_trace_mib: list[tuple[float, float]]  # (seconds into the run, RSS), ~20 points
    # Live Python objects in the server before and after the run (both idle).
    objects_before: int = 0
    objects_after: int = 0

    @property
    def rss_growth_mib(self) -> float:
        return self.rss_second_mib - self.rss_first_mib

    def table(self) -> str:
        rej = ", ".join(f"{k}: {v}" for k, v in sorted(self.rejected.items()))
        rows = [
            ("duration", f"{self.duration_s:.0f} s"),
            ("offered load", f"{self.offered_rps:.1f} req/s "
                             f"({self.offered_rps / max(self.sustained_rps, 1e-9):.1f}x the "
                             f"{self.sustained_rps:.1f} req/s it sustains)"),
            ("requests sent", str(self.num_sent)),
            ("accepted (reached the engine)", str(self.accepted)),
            ("  completed", str(self.completed)),
            ("  aborted (client left)", str(self.aborted)),
            ("  errored (injected faults)", str(self.errored)),
            ("rejected", f"{sum(self.rejected.values())} ({rej})"),
            ("cancelled before admission", str(self.cancelled_before_engine)),
            ("lost", str(self.lost)),
            ("ended twice", str(self.duplicates)),
            ("blocks leaked", f"{self.blocks_leaked} of {self.num_blocks}"),
            ("preemptions", f"{self.preemptions:.0f}"),
            ("prefix cache hit rate", f"{100 * self.prefix_cache_hit_rate:.0f}%"),
            ("/health max latency", f"{1000 * self.health_max_s:.0f} ms "
                                    f"({self.health_failures} over 1 s or failed)"),
            ("server RSS 1st -> 2nd half", f"{self.rss_first_mib:.1f} -> "
                                           f"{self.rss_second_mib:.1f} MiB "
                                           f"({self.rss_growth_mib:+.1f} MiB)"),
            ("live Python objects", f"{self.objects_before} -> {self.objects_after} "
                                    f"({self.objects_after - self.objects_before:+d})"),
            ("greedy under load == serial", f"{self.greedy_checked - self.greedy_mismatches} "
                                            f"of {self.greedy_checked}"),
            ("problems", str(len(self.problems))),
        ]
        w = max(len(k) for k, _ in rows)
        lines = ["=" * 20 + " iterserve soak " + "=" * 20]
        lines += [f"{k:<{w}}  {v}" for k, v in rows]
        lines += [f"  ! {p}" for p in self.problems[:20]]
        return "\n".join(lines)


def _public_id(engine_id: str) -> str:
    m = _ENGINE_ID.match(engine_id)
    return m.group(1) if m else engine_id


def run_soak(model_path: Path, cfg: SoakConfig, workdir: Path) -> SoakReport:
    with ServerProcess(model_path, cfg, workdir / "server.log") as server:
        try:
            return asyncio.run(_soak(server, cfg))
        except BaseException:
            print(server.log_path.read_text()[-5000:])
            raise


async def _soak(server: ServerProcess, cfg: SoakConfig) -> SoakReport:
    url = server.base_url
    driver = Driver(server, cfg)
    workload = Workload(cfg, cfg.seed)
    # Warm up and measure what the server sustains (closed loop, as many as it runs).
    sustained = await driver.run_closed_loop(cfg.max_num_seqs, cfg.calibrate_s, workload,
                                             "warm")
    await asyncio.to_thread(wait_idle, url)
    state0 = await asyncio.to_thread(read_state, url, True)
    metrics0 = await asyncio.to_thread(read_metrics, url)
    driver.outcomes.clear()
    driver.num_sent = 0

    stop = asyncio.Event()
    health: list[float] = []
    rss: list[tuple[float, float]] = []
    finished: list[list] = []  # the engine's finish log, drained as the run goes
    health_stop = threading.Event()
    health_thread = threading.Thread(
        target=_poll_health, args=(url, cfg.health_poll_s, health_stop, health), daemon=True)
    health_thread.start()
    pollers = [asyncio.create_task(_sample_rss(server, cfg.rss_sample_s, stop, rss)),
               asyncio.create_task(_drain_log(url, stop, finished))]
    # A hang needs the step timeout; it is on only around the hang (a busy machine can
    # stall an ordinary step past a short timeout, and that would be a fault we did not mean).
    faults = sorted([(f, "raise") for f in cfg.raise_at] + [(f, "hang") for f in cfg.hang_at]
                    + [(f + 0.1, "reset") for f in cfg.hang_at])
    injected: list[str] = []

    async def on_fraction(frac: float) -> None:
        while faults and frac >= faults[0][0]:
            _, kind = faults.pop(0)
            body = {
                "raise": {"kind": "raise", "count": 1},
                "hang": {"kind": "hang", "count": 1, "seconds": cfg.step_timeout_s * 2,
                         "step_timeout_s": cfg.step_timeout_s},
                "reset": {"kind": "none", "step_timeout_s": None},
            }[kind]
            async with httpx.AsyncClient() as c:
                r = await c.post(url + "/_test/fault", json=body, headers=AUTH)
                r.raise_for_status()
            if kind != "reset":
                injected.append(kind)

    objects0 = await count_objects(url)
    t0 = time.monotonic()
    offered = await driver.run_open_loop(sustained * cfg.overload, cfg.duration_s, workload,
                                         "soak", on_fraction)
    t_mid = t0 + cfg.duration_s / 2
    t_end = t0 + cfg.duration_s
    stop.set()
    health_stop.set()
    await asyncio.gather(*pollers)
    await asyncio.to_thread(health_thread.join, 5)
    async with httpx.AsyncClient() as c:
        await c.post(url + "/_test/fault", json={"kind": "none", "step_timeout_s": None},
                     headers=AUTH)
    state = await asyncio.to_thread(wait_idle, url)
    state = await asyncio.to_thread(read_state, url, True)
    state["finished"] = finished + state["finished"]
    metrics1 = await asyncio.to_thread(read_metrics, url)

    # Greedy probes, now served one at a time on the idle server.
    serial: dict[str, str] = {}
    async with httpx.AsyncClient(timeout=60) as c:
        for prompt in workload.greedy_prompts:
            r = await c.post(url + "/v1/completions", headers=AUTH, json={
                "model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0.0,
                "ignore_eos": True})
            serial[prompt] = r.json()["choices"][0]["text"]
    await asyncio.to_thread(wait_idle, url)
    read_state(url, drain=True)
    objects1 = await count_objects(url)
    report = _audit(cfg, driver, state, state0, metrics0, metrics1, health, rss, t_mid, t_end,
                    serial, sustained, offered, injected)
    report.objects_before = objects0["num_objects"]
    report.objects_after = objects1["num_objects"]
    return report


def _audit(cfg: SoakConfig, driver: Driver, state: dict, state0: dict,
           metrics0: dict[str, float], metrics1: dict[str, float], health: list[float],
           rss: list[tuple[float, float]], t_mid: float, t_end: float, serial: dict[str, str],
           sustained: float, offered: float, injected: list[str]) -> SoakReport:
    problems: list[str] = []
    # The engine's log: public id -> {child index: [finish reasons]}.
    log: dict[str, dict[int, list[str]]] = {}
    for engine_id, index, reason in state["finished"]:
        log.setdefault(_public_id(engine_id), {}).setdefault(index, []).append(reason)
    duplicates = sum(len(v) - 1 for ch in log.values() for v in ch.values() if len(v) > 1)
    by_id = {o.rid: o for o in driver.outcomes}
    for rid in log:
        if rid not in by_id:
            problems.append(f"the engine ran {rid}, which no client sent")

    accepted = completed = aborted = errored = lost = cancelled_before = 0
    rejected: Counter[int] = Counter()
    finish_counts: Counter[str] = Counter()
    greedy_checked = greedy_bad = 0
    for o in driver.outcomes:
        if o.problem:
            problems.append(f"{o.rid} ({o.kind}, {o.result}, {o.status}): {o.problem}")
        children = log.get(o.rid)
        if o.result == "lost":
            lost += 1
        if o.result == "rejected":
            rejected[o.status or 0] += 1
            if children is not None:
                problems.append(f"{o.rid} was rejected ({o.status}) but reached the engine")
            continue
        if children is None:
            if o.result == "cancelled":
                cancelled_before += 1  # the client left before its request was admitted
            elif o.result in ("completed", "errored"):
                lost += 1
                problems.append(f"{o.rid} was answered ({o.result}) but the engine never "
                                "ended it")
            continue
        accepted += 1
        reasons = {i: r[0] for i, r in children.items()}
        finish_counts.update(reasons.values())
        if sorted(reasons) != list(range(o.num_children)):
            lost += o.num_children - len(reasons)
            problems.append(f"{o.rid}: children {sorted(reasons)} ended, want "
                            f"{o.num_children}")
        vals = set(reasons.values())
        if "error" in vals:
            errored += 1
            if o.result not in ("errored", "cancelled"):
                problems.append(f"{o.rid}: the engine failed it but the client saw {o.result}")
        elif "abort" in vals:
            aborted += 1
            if o.result != "cancelled":
                problems.append(f"{o.rid}: aborted, but its client did not leave ({o.result})")
        else:
            completed += 1
            if o.result == "completed" and reasons != o.finish_reasons:
                problems.append(f"{o.rid}: client saw {o.finish_reasons}, engine {reasons}")
        if o.result == "errored" and "error" not in vals:
            problems.append(f"{o.rid}: the client saw an error the engine did not log")
        if o.greedy_prompt is not None and o.result == "completed":
            greedy_checked += 1
            if o.texts.get(0) != serial[o.greedy_prompt]:
                greedy_bad += 1
                problems.append(f"{o.rid}: greedy text under load {o.texts.get(0)!r} != "
                                f"serial {serial[o.greedy_prompt]!r}")

    # The engine holds nothing now.
    held = {k: state[k] for k in ("num_streams", "num_unfinished_requests",
                                  "num_admitted_requests", "num_admitted_tokens")}
    if any(held.values()):
        problems.append(f"still held after the drain: {held}")
        lost += state["num_unfinished_requests"]
    blocks_leaked = state["num_blocks"] - state["num_free_blocks"]
    if blocks_leaked or state["num_leak_reports"] != state0["num_leak_reports"]:
        problems.append(f"KV blocks leaked: {blocks_leaked}, leak reports "
                        f"{state['num_leak_reports']}")

    p = "iterserve:"

    def delta(key: str) -> float:
        return metrics1.get(p + key, 0.0) - metrics0.get(p + key, 0.0)

    for g in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
              "num_requests_admitted"):
        if metrics1[p + g] != 0:
            problems.append(f"/metrics {g} = {metrics1[p + g]} after the drain")
    deltas = {}
    for reason in ("stop", "length", "abort", "error"):
        d = delta(f"request_success_total{{finished_reason={reason}}}")
        deltas[reason] = d
        if d != finish_counts[reason]:
            problems.append(f"/metrics request_success_total{{{reason}}} grew by {d}, the "
                            f"engine log has {finish_counts[reason]}")
    d429 = sum(delta(f"admission_rejections_total{{reason={r}}}")
               for r in ("queue_requests", "queue_tokens"))
    deltas["admission_rejections"] = d429
    # A client that gave up while its request was being refused never saw the 429.
    if not rejected[429] <= d429 <= rejected[429] + cancelled_before:
        problems.append(f"/metrics admission_rejections_total grew by {d429}, clients got "
                        f"{rejected[429]} 429s (and {cancelled_before} gave up unanswered)")
    preemptions = delta("num_preemptions_total")
    queries = delta("prefix_cache_queries_total")
    hits = delta("prefix_cache_hits_total")
    if not injected or len(injected) != len(cfg.raise_at) + len(cfg.hang_at):
        problems.append(f"faults injected: {injected}")

    # /health within 1 s throughout.
    health_failures = sum(1 for h in health if h > 1.0)
    if health_failures or not health:
        problems.append(f"/health: {health_failures} of {len(health)} polls over 1 s")
    # RSS: the peak of each half.
    first = [m for t, m in rss if t < t_mid]
    second = [m for t, m in rss if t_mid <= t <= t_end]
    rss1, rss2 = (max(first) if first else 0.0), (max(second) if second else 0.0)
    return SoakReport(
        duration_s=cfg.duration_s, sustained_rps=sustained, offered_rps=offered,
        num_sent=driver.num_sent, accepted=accepted, completed=completed, aborted=aborted,
        errored=errored, rejected=dict(rejected), cancelled_before_engine=cancelled_before,
        lost=lost, duplicates=duplicates, blocks_leaked=blocks_leaked,
        num_blocks=state["num_blocks"], preemptions=preemptions,
        prefix_cache_hit_rate=hits / queries if queries else 0.0,
        health_max_s=max(health) if health else float("inf"), health_failures=health_failures,
        rss_first_mib=rss1, rss_second_mib=rss2, greedy_checked=greedy_checked,
        greedy_mismatches=greedy_bad, problems=problems, finish_counts=dict(finish_counts),
        metric_deltas=deltas,
        rss_trace_mib=[(round(t - (t_end - cfg.duration_s), 1), round(m, 1))
                       for t, m in rss[:: max(1, len(rss) // 20)]],
    )
