"""``iterserve bench serve``: drive an OpenAI-compatible server with a workload.

The dispatcher sleeps until each request's arrival time (Poisson / gamma gaps,
a trace's timestamps, or all at once), then starts it as a task; a semaphore
caps the requests in flight at ``max_concurrency``, like a gateway in front of
the server would. All requests share one HTTP session with keep-alive (or, with
``disable_keep_alive``, a connection per request, for servers that close
keep-alive connections; a request that a reused connection lost unanswered is
resent either way: see bench/client.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from iterserve.bench.client import (
    RequestFuncInput,
    RequestFuncOutput,
    keepalive_trace,
    request_openai,
)
from iterserve.bench.datasets import SampleRequest
from iterserve.bench.metrics import METRIC_NAMES, RequestRecord, calculate_metrics, format_table
from iterserve.bench.prompts import BenchTokenizer
from iterserve.bench.results import build_result
from iterserve.measure.arrivals import RAMP_UP_STRATEGIES, arrival_times, ramp_up_arrival_times

# ``vllm bench serve --backend`` values this client speaks: completions or chat.
BACKENDS = ("openai", "openai-chat", "vllm")


@dataclass(slots=True)
class BenchConfig:
    """How to send a workload; the CLI flags map one to one onto these fields."""

    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"
    # vLLM's --backend; None: the one the endpoint implies.
    backend: str | None = None
    model: str | None = None  # None: the first model /v1/models lists
    request_rate: float | None = None  # None: inf, or the trace's own timestamps
    burstiness: float = 1.0
    # vLLM's ramp-up: the rate goes from start to end rps over the run's requests.
    ramp_up_strategy: str | None = None
    ramp_up_start_rps: float | None = None
    ramp_up_end_rps: float | None = None
    max_concurrency: int | None = None
    seed: int = 0
    ignore_eos: bool = False
    # Sent as given; what is left out (temperature, ...) the server decides.
    sampling: dict[str, Any] = field(default_factory=dict)
    extra_body: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    api_key: str | None = None
    goodput_slos_ms: dict[str, float] = field(default_factory=dict)
    percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl")
    metric_percentiles: tuple[float, ...] = (99.0,)
    request_timeout_s: float = 6 * 3600.0
    # A new connection per request (Connection: close), for servers whose keep-alive
    # policy closes connections under the client.
    disable_keep_alive: bool = False
    num_warmups: int = 0
    ready_check_timeout_s: float = 0.0
    disable_tqdm: bool = False

    @property
    def api_url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint

    @property
    def is_chat(self) -> bool:
        return "chat" in self.endpoint

    @property
    def backend_name(self) -> str:
        if self.backend is not None:
            return self.backend
        return "openai-chat" if self.is_chat else "openai"

    def validate(self) -> None:
        if self.backend is not None:
            if self.backend not in BACKENDS:
                raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
            if (self.backend == "openai-chat") != self.is_chat:
                raise ValueError(
                    f"backend {self.backend!r} does not speak endpoint {self.endpoint!r}: "
                    "openai-chat sends chat requests (/v1/chat/completions), openai and vllm "
                    "completions requests (/v1/completions)")
        if self.ramp_up_strategy is not None:
            if self.ramp_up_strategy not in RAMP_UP_STRATEGIES:
                raise ValueError(f"ramp_up_strategy must be one of {RAMP_UP_STRATEGIES}, "
                                 f"got {self.ramp_up_strategy!r}")
            if self.ramp_up_start_rps is None or self.ramp_up_end_rps is None:
                raise ValueError("ramp_up_strategy needs ramp_up_start_rps and ramp_up_end_rps")
            if self.request_rate is not None and not math.isinf(self.request_rate):
                raise ValueError("ramp_up_strategy sets the rate: leave request_rate unset")
            ramp_up_arrival_times(2, self.ramp_up_strategy, self.ramp_up_start_rps,
                                  self.ramp_up_end_rps)  # the rates' own checks
        elif self.ramp_up_start_rps is not None or self.ramp_up_end_rps is not None:
            raise ValueError("ramp_up_start_rps / ramp_up_end_rps need ramp_up_strategy")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 or inf, got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        bad = set(self.percentile_metrics) - set(METRIC_NAMES)
        if bad:
            raise ValueError(f"percentile_metrics: unknown {sorted(bad)}; choose from {METRIC_NAMES}")
        if any(not 0 <= p <= 100 for p in self.metric_percentiles):
            raise ValueError(f"metric_percentiles must be in [0, 100], got {self.metric_percentiles}")


def schedule_offsets(requests: list[SampleRequest], cfg: BenchConfig) -> np.ndarray:
    """Send offsets in seconds from the run's start for each request.

    A trace with timestamps replays them unless ``request_rate`` is set; a rate
    draws gamma gaps (Poisson at burstiness 1) from the shared generator, so they
    equal ``simulate --arrival gamma``'s for the same seed; no rate sends
    everything at once. A ramp-up draws gaps whose rate goes from its start to its
    end rps (``measure.arrivals.ramp_up_arrival_times``).
    """
    n = len(requests)
    if cfg.ramp_up_strategy is not None:
        assert cfg.ramp_up_start_rps is not None and cfg.ramp_up_end_rps is not None
        return ramp_up_arrival_times(n, cfg.ramp_up_strategy, cfg.ramp_up_start_rps,
                                     cfg.ramp_up_end_rps, cfg.burstiness, cfg.seed)
    if cfg.request_rate is None and any(r.arrival_time is not None for r in requests):
        return np.array([r.arrival_time or 0.0 for r in requests])
    rate = cfg.request_rate if cfg.request_rate is not None else math.inf
    return arrival_times(n, "gamma", rate, cfg.burstiness, cfg.seed)


def _record(
    req: SampleRequest,
    out: RequestFuncOutput,
    arrival: float,
    t0: float,
    tokenizer: BenchTokenizer | None,
    save_text: bool,
) -> RequestRecord:
    if out.output_tokens is not None:
        output_len = out.output_tokens
    elif tokenizer is not None and out.generated_text:
        output_len = len(tokenizer.encode(out.generated_text))
    else:
        output_len = out.num_chunks  # one token per chunk is what servers stream
    return RequestRecord(
        arrival_time=arrival,
        send_time=out.start_time - t0,
        prompt_len=out.prompt_len,
        output_len=output_len if out.success else 0,
        expected_output_len=req.expected_output_len,
        ttft=out.ttft,
        itls=out.itl,
        e2el=out.latency,
        success=out.success,
        error=out.error,
        error_code=out.error_code,
        retries=out.retries,
        priority=req.priority,
        tenant=req.tenant,
        generated_text=out.generated_text if save_text else None,
    )


def make_session(cfg: BenchConfig) -> aiohttp.ClientSession:
    # One pool, keep-alive, capped at max_concurrency so no connection sits idle.
    connector = aiohttp.TCPConnector(
        limit=cfg.max_concurrency or 0,
        limit_per_host=cfg.max_concurrency or 0,
        keepalive_timeout=None if cfg.disable_keep_alive else 60,
        force_close=cfg.disable_keep_alive,
    )
    return aiohttp.ClientSession(
        connector=connector,
        trace_configs=[keepalive_trace()],
        timeout=aiohttp.ClientTimeout(total=cfg.request_timeout_s),
        trust_env=False,
    )


def _auth_headers(cfg: BenchConfig) -> dict[str, str]:
    headers = dict(cfg.headers)
    if cfg.api_key:
        headers["Authorization"] = f"Bearer {cfg.api_key}"
    return headers


async def fetch_first_model(session: aiohttp.ClientSession, cfg: BenchConfig) -> str:
    url = cfg.base_url.rstrip("/") + "/v1/models"
    async with session.get(url, headers=_auth_headers(cfg)) as resp:
        resp.raise_for_status()
        data = await resp.json()
    models = data.get("data") or []
    if not models:
        raise RuntimeError(f"{url} lists no models; pass --model")
    return str(models[0]["id"])


def _input(req: SampleRequest, cfg: BenchConfig, model: str) -> RequestFuncInput:
    return RequestFuncInput(
        api_url=cfg.api_url,
        model=model,
        prompt=req.prompt,
        prompt_len=req.prompt_len,
        output_len=req.expected_output_len,
        is_chat=cfg.is_chat,
        ignore_eos=cfg.ignore_eos,
        priority=req.priority,
        tenant=req.tenant,
        sampling=cfg.sampling,
        extra_body=cfg.extra_body,
        headers=({**_auth_headers(cfg), "X-Session-Id": req.session_id}
                 if req.session_id is not None else _auth_headers(cfg)),
    )


async def run_benchmark(
    requests: list[SampleRequest],
    cfg: BenchConfig,
    tokenizer: BenchTokenizer | None = None,
    *,
    save_text: bool = False,
    verbose: bool = True,
) -> tuple[list[RequestRecord], float, str]:
    """Send ``requests``; returns (per-request records, duration in s, model name)."""
    cfg.validate()
    if not requests:
        raise ValueError("no requests to send")
    if cfg.is_chat and any(not isinstance(r.prompt, str) for r in requests):
        raise ValueError("token-id prompts (--send-token-ids) need --endpoint /v1/completions")
    say = print if verbose else (lambda *a, **k: None)
    offsets = schedule_offsets(requests, cfg)
    async with make_session(cfg) as session:
        model = cfg.model or await fetch_first_model(session, cfg)
        if cfg.ready_check_timeout_s > 0:
            await _wait_ready(session, _input(requests[0], cfg, model), cfg.ready_check_timeout_s)
            say("Initial test run completed.")
        if cfg.num_warmups > 0:
            say(f"Warming up with {cfg.num_warmups} requests...")
            warm = _input(requests[0], cfg, model)
            await asyncio.gather(*(request_openai(warm, session) for _ in range(cfg.num_warmups)))
        rate = cfg.request_rate
        if cfg.ramp_up_strategy is not None:
            say(f"Traffic ramp-up strategy: {cfg.ramp_up_strategy}, from "
                f"{cfg.ramp_up_start_rps} to {cfg.ramp_up_end_rps} RPS")
        elif rate is None and requests[0].arrival_time is not None:
            say("Replaying the trace's arrival times.")
        else:
            dist = "Poisson process" if cfg.burstiness == 1.0 else "Gamma distribution"
            say(f"Traffic request rate: {rate if rate is not None else math.inf}")
            say(f"Burstiness factor: {cfg.burstiness} ({dist})")
        say(f"Maximum request concurrency: {cfg.max_concurrency}")

        pbar = None
        if not cfg.disable_tqdm:
            from tqdm.asyncio import tqdm

            pbar = tqdm(total=len(requests), desc="requests", unit="req")
        semaphore = (
            asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else contextlib.nullcontext()
        )

        async def one(req: SampleRequest) -> RequestFuncOutput:
            async with semaphore:
                out = await request_openai(_input(req, cfg, model), session)
            if pbar is not None:
                pbar.update(1)
            return out

        t0 = time.perf_counter()
        tasks = []
        for req, offset in zip(requests, offsets, strict=True):
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        if pbar is not None:
            pbar.close()
    resent = sum(out.retries for out in outputs)
    if resent:
        say(f"Resent {resent} requests whose reused keep-alive connection the server "
            "closed before answering (not failures; --disable-keep-alive avoids them)")
    records = [
        _record(req, out, float(off), t0, tokenizer, save_text)
        for req, out, off in zip(requests, outputs, offsets, strict=True)
    ]
    return records, duration, model


async def _wait_ready(
    session: aiohttp.ClientSession, inp: RequestFuncInput, timeout_s: float
) -> None:
    deadline = time.perf_counter() + timeout_s
    while True:
        out = await request_openai(inp, session)
        if out.success:
            return
        if time.perf_counter() >= deadline:
            raise RuntimeError(f"endpoint not ready after {timeout_s:.0f}s: {out.error}")
        await asyncio.sleep(1.0)


def run_config_dict(cfg: BenchConfig, model: str, **extra: Any) -> dict[str, Any]:
    """The run's settings as they go in the result file (never the API key)."""
    rate = cfg.request_rate
    return {
        "source": "measured",
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": cfg.backend_name,
        "endpoint_type": cfg.backend_name,  # vLLM writes both
        "base_url": cfg.base_url,
        "endpoint": cfg.endpoint,
        "model_id": model,
        "request_rate": "inf" if rate is None or math.isinf(rate) else rate,
        "burstiness": cfg.burstiness,
        "ramp_up_strategy": cfg.ramp_up_strategy,
        "ramp_up_start_rps": cfg.ramp_up_start_rps,
        "ramp_up_end_rps": cfg.ramp_up_end_rps,
        "max_concurrency": cfg.max_concurrency,
        "seed": cfg.seed,
        "ignore_eos": cfg.ignore_eos,
        "metric_percentiles": list(cfg.metric_percentiles),
        **extra,
    }


def benchmark(
    requests: list[SampleRequest],
    cfg: BenchConfig,
    tokenizer: BenchTokenizer | None = None,
    *,
    save_detailed: bool = False,
    verbose: bool = True,
    extra_config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run the workload, print the table, return the result dict (not yet saved)."""
    records, duration, model = asyncio.run(
        run_benchmark(requests, cfg, tokenizer, save_text=save_detailed, verbose=verbose)
    )
    metrics = calculate_metrics(
        records, duration, list(cfg.metric_percentiles), cfg.goodput_slos_ms
    )
    if verbose:
        failed = [r for r in records if not r.success]
        if failed:
            print(f"{len(failed)} requests failed; the first few errors:")
            for r in failed[:5]:
                print(f"  [{r.error_code}] {r.error}")
        print(
            format_table(
                metrics,
                max_concurrency=cfg.max_concurrency,
                request_rate=cfg.request_rate if cfg.request_rate is not None else math.inf,
                goodput_slos_ms=cfg.goodput_slos_ms,
                percentile_metrics=cfg.percentile_metrics,
            )
        )
    config = run_config_dict(cfg, model, num_prompts=len(requests), **(extra_config or {}))
    return build_result(
        records, metrics, config,
        goodput_slos_ms=cfg.goodput_slos_ms, save_detailed=save_detailed,
        percentile_metrics=cfg.percentile_metrics,
    )


def result_filename(
    label: str | None, request_rate: float | None, max_concurrency: int | None, model: str
) -> str:
    """vLLM's naming: ``{label}-{rate}qps[-concurrency{c}]-{model}-{date}.json``."""
    rate = "inf" if request_rate is None or math.isinf(request_rate) else f"{request_rate:g}"
    conc = f"-concurrency{max_concurrency}" if max_concurrency is not None else ""
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{label or 'iterserve'}-{rate}qps{conc}-{Path(model).name}-{date}.json"
