"""The soak's clients: a weighted mix of good, bad, impatient and vanishing requests."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from .server import AUTH, ERROR_KEYS, MODEL, ServerProcess, SoakConfig

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


