"""Prometheus collectors under vLLM's metric names, and the periodic stats log line.

Names, labels (``model_name`` and ``engine``, the engine's index: ``"0"``) and the
admission-rejection reasons are vLLM V1's after the prefix (``iterserve:`` by default,
``vllm:`` with ``--metrics-prefix vllm``) so a Grafana dashboard built for vLLM reads
this server unchanged. Every collector lives in a per-instance registry: several servers (tests)
can share one process. prometheus-client collectors are thread-safe, so the engine
thread and the event loop both update them directly.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from iterserve.measure.latency import RequestMetrics, time_to_first_token

logger = logging.getLogger("iterserve.metrics")

CONTENT_TYPE = CONTENT_TYPE_LATEST

# vLLM's buckets, so dashboards' quantile panels line up.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0]
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
REQUEST_PARAMS_N_BUCKETS = [1, 2, 5, 10, 20]
REQUEST_NUM_PREEMPTIONS_BUCKETS = [1, 2, 3, 4, 5, 10, 20]
# The engine's index in vLLM's ``engine`` label (one engine per server here).
ENGINE_INDEX = "0"
# Admission-rejection reasons, as vLLM names them (the queue cap that refused).
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")

# Sample names /metrics must carry (after the prefix); tests and docs read this list.
METRIC_NAMES = (
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
    "num_preemptions_total",
    "prompt_tokens_total",
    "generation_tokens_total",
    "request_success_total",
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "iteration_tokens_total",
    "admission_rejections_total",
    "prompt_tokens_cached_total",
    "request_time_per_output_token_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "request_inference_time_seconds",
    "request_prompt_tokens",
    "request_generation_tokens",
    "request_params_n",
    "request_params_max_tokens",
    "request_num_preemptions",
    "request_prefill_kv_computed_tokens",
    "request_max_num_generation_tokens",
    "cache_config_info",
    "spec_decode_num_drafts_total",
    "spec_decode_num_draft_tokens_total",
    "spec_decode_num_accepted_tokens_total",
)


def request_token_buckets(max_model_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_model_len`` (vLLM's token-count buckets)."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return out
            out.append(m * scale)
        scale *= 10


@dataclass(slots=True)
class SchedulerSnapshot:
    """The scheduler state after the latest step, copied out of the engine thread."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_blocks: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Speculative decoding, cumulative (core.spec_decode.SpecDecodeStats).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()


class Metrics:
    """All collectors of one server, labelled with its model name as vLLM does."""

    def __init__(self, model_name: str, prefix: str = "iterserve") -> None:
        self.registry = CollectorRegistry()
        self.prefix = prefix
        p = f"{prefix}:"
        r = self.registry
        lbl = ["model_name", "engine"]
        values = (model_name, ENGINE_INDEX)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(p + name, doc, lbl, registry=r).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(p + name, doc, lbl, registry=r).labels(*values)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(p + name, doc, lbl, buckets=buckets, registry=r).labels(*values)

        self._histogram = histogram

        self.num_requests_running = gauge("num_requests_running", "Requests in the running set.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to run.")
        self.kv_cache_usage_perc = gauge(
            "kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full)."
        )
        self.num_requests_admitted = gauge(
            "num_requests_admitted", "Requests admitted by the server and not yet finished."
        )
        self.engine_healthy = gauge("engine_healthy", "1 while the engine loop is alive.")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found cached.")
        self.num_preemptions = counter("num_preemptions", "Cumulative preemptions.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.prompt_tokens_cached = counter(
            "prompt_tokens_cached", "Prompt tokens found in the prefix cache, per admitted request."
        )
        self._request_success = Counter(
            p + "request_success",
            "Finished requests, by finish reason.",
            [*lbl, "finished_reason"],
            registry=r,
        )
        # vLLM counts rejections in the frontend, without an engine label.
        self._admission_rejections = Counter(
            p + "admission_rejections",
            "Requests refused by a queue limit, by reason.",
            ["model_name", "reason"],
            registry=r,
        )
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds",
            "Time between consecutive token-bearing outputs of a request.",
            ITL_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduled.", LATENCY_BUCKETS
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens scheduled per engine step.", ITERATION_TOKEN_BUCKETS
        )
        self.request_time_per_output_token = histogram(
            "request_time_per_output_token_seconds",
            "Per finished request, its TPOT (requests with one output token left out).",
            ITL_BUCKETS,
        )
        self.request_prefill_time = histogram(
            "request_prefill_time_seconds", "First scheduled to first token.", LATENCY_BUCKETS
        )
        self.request_decode_time = histogram(
            "request_decode_time_seconds", "First token to last token.", LATENCY_BUCKETS
        )
        self.request_inference_time = histogram(
            "request_inference_time_seconds", "First scheduled to last token.", LATENCY_BUCKETS
        )
        self.request_params_n = histogram(
            "request_params_n", "The n request parameter, per prompt.", REQUEST_PARAMS_N_BUCKETS
        )
        self.request_num_preemptions = histogram(
            "request_num_preemptions", "Times a finished request was preempted.",
            REQUEST_NUM_PREEMPTIONS_BUCKETS,
        )
        # Speculative decoding (vLLM V1's spec_decode metrics; 0 while it is off).
        self.spec_decode_num_drafts = counter(
            "spec_decode_num_drafts", "Draft sequences verified (one per request per step).")
        self.spec_decode_num_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_decode_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._spec_per_pos = Counter(
            p + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft (0 = first).",
            [*lbl, "position"], registry=r)
        self._model_name = model_name
        # Pre-create the label sets dashboards expect, so the names appear before traffic.
        for reason in ("stop", "length", "abort", "error"):
            self._request_success.labels(*values, reason)
        for reason in ADMISSION_REASONS:
            self._admission_rejections.labels(model_name, reason)
        # Token-count histograms: their buckets follow the context length (attach_engine).
        self.request_prompt_tokens: Histogram | None = None
        self.request_generation_tokens: Histogram | None = None
        self.request_params_max_tokens: Histogram | None = None
        self.request_prefill_kv_computed_tokens: Histogram | None = None
        self.request_max_num_generation_tokens: Histogram | None = None

        # For the log line: totals since start (the engine thread writes, a timer reads).
        self._lock = threading.Lock()
        self.snapshot = SchedulerSnapshot()
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._last_log = (time.monotonic(), 0, 0)

    def attach_engine(self, max_model_len: int, cache_config: object | None = None) -> None:
        """Once the engine is built: the token-count histograms (buckets up to
        ``max_model_len``) and ``cache_config_info`` (the resolved cache config's fields
        as labels, value 1), as vLLM exposes them. A second call does nothing."""
        if self.request_prompt_tokens is not None:
            return
        buckets = request_token_buckets(max_model_len)
        self.request_prompt_tokens = self._histogram(
            "request_prompt_tokens", "Prompt tokens of a finished request.", buckets
        )
        self.request_generation_tokens = self._histogram(
            "request_generation_tokens", "Generated tokens of a finished request.", buckets
        )
        self.request_params_max_tokens = self._histogram(
            "request_params_max_tokens", "The max_tokens request parameter.", buckets
        )
        self.request_max_num_generation_tokens = self._histogram(
            "request_max_num_generation_tokens",
            "Per prompt of a finished request, the most tokens one of its samples generated.",
            buckets,
        )
        self.request_prefill_kv_computed_tokens = self._histogram(
            "request_prefill_kv_computed_tokens",
            "Prompt tokens a finished request computed (not from the prefix cache).", buckets
        )
        if cache_config is not None:
            fields = getattr(cache_config, "__dataclass_fields__", None) or vars(cache_config)
            info = {k: str(getattr(cache_config, k)) for k in fields}
            info["engine"] = ENGINE_INDEX
            Gauge(f"{self.prefix}:cache_config_info", "The engine's KV cache configuration.",
                  list(info), registry=self.registry).labels(**info).set(1)

    # -- updates --------------------------------------------------------------------

    def observe_step(self, snap: SchedulerSnapshot, num_scheduled_tokens: int) -> None:
        """After each engine step (engine thread): gauges and the cumulative counters."""
        prev = self.snapshot
        self.num_requests_running.set(snap.num_running)
        self.num_requests_waiting.set(snap.num_waiting)
        self.kv_cache_usage_perc.set(snap.kv_cache_usage)
        # Scheduler counters are cumulative; Prometheus counters take increments.
        if snap.num_preemptions > prev.num_preemptions:
            self.num_preemptions.inc(snap.num_preemptions - prev.num_preemptions)
        if snap.prefix_cache_queries > prev.prefix_cache_queries:
            self.prefix_cache_queries.inc(snap.prefix_cache_queries - prev.prefix_cache_queries)
        if snap.prefix_cache_hits > prev.prefix_cache_hits:
            self.prefix_cache_hits.inc(snap.prefix_cache_hits - prev.prefix_cache_hits)
        if num_scheduled_tokens > 0:
            self.iteration_tokens.observe(num_scheduled_tokens)
        if snap.spec_num_drafts > prev.spec_num_drafts:
            self._observe_spec(snap, prev)
        self.snapshot = snap

    def _observe_spec(self, snap: SchedulerSnapshot, prev: SchedulerSnapshot) -> None:
        self.spec_decode_num_drafts.inc(snap.spec_num_drafts - prev.spec_num_drafts)
        self.spec_decode_num_draft_tokens.inc(
            snap.spec_num_draft_tokens - prev.spec_num_draft_tokens)
        if snap.spec_num_accepted_tokens > prev.spec_num_accepted_tokens:
            self.spec_decode_num_accepted_tokens.inc(
                snap.spec_num_accepted_tokens - prev.spec_num_accepted_tokens)
        old = prev.spec_accepted_per_pos
        for pos, n in enumerate(snap.spec_accepted_per_pos):
            d = n - (old[pos] if pos < len(old) else 0)
            if d > 0:
                self._spec_per_pos.labels(self._model_name, ENGINE_INDEX, str(pos)).inc(d)

    def observe_tokens(self, num_prompt: int, num_generated: int) -> None:
        if num_prompt:
            self.prompt_tokens.inc(num_prompt)
        if num_generated:
            self.generation_tokens.inc(num_generated)
        with self._lock:
            self._num_prompt_tokens += num_prompt
            self._num_generation_tokens += num_generated

    def observe_new_tokens(
        self, arrival_time: float, prev_output_time: float | None, now: float
    ) -> None:
        """One output of a request that carries tokens, at ``now``: its TTFT when it is
        the first (``prev_output_time`` None), else one ITL (docs/metrics.md)."""
        if prev_output_time is None:
            ttft = time_to_first_token(arrival_time, now)
            if ttft is not None:
                self.time_to_first_token.observe(ttft)
        else:
            self.inter_token_latency.observe(now - prev_output_time)

    def observe_admitted(self, num_cached_tokens: int) -> None:
        """A request's first token: the prompt tokens the prefix cache supplied."""
        if num_cached_tokens:
            self.prompt_tokens_cached.inc(num_cached_tokens)

    def observe_finished(
        self, finish_reason: str, m: RequestMetrics, max_tokens: int | None = None
    ) -> None:
        """One finished request (a child: one sample of one prompt). A phase it never
        reached (an abort while waiting) is left out of that phase's histogram."""
        self._request_success.labels(self._model_name, ENGINE_INDEX, finish_reason).inc()
        for hist, value in (
            (self.e2e_request_latency, m.e2e_latency),
            (self.request_queue_time, m.queue_time),
            (self.request_prefill_time, m.prefill_time),
            (self.request_decode_time, m.decode_time),
            (self.request_inference_time, m.inference_time),
            (self.request_time_per_output_token, m.tpot),
        ):
            if value is not None:
                hist.observe(value)
        self.request_num_preemptions.observe(m.num_preemptions)
        if self.request_prompt_tokens is not None:
            self.request_prompt_tokens.observe(m.num_prompt_tokens)
        if self.request_generation_tokens is not None:
            self.request_generation_tokens.observe(m.num_output_tokens)
        if self.request_prefill_kv_computed_tokens is not None:
            self.request_prefill_kv_computed_tokens.observe(
                max(m.num_prompt_tokens - m.num_cached_tokens, 0))
        if max_tokens and self.request_params_max_tokens is not None:
            self.request_params_max_tokens.observe(max_tokens)

    def observe_parent(self, n: int, max_output_tokens: Sequence[int]) -> None:
        """A finished user request, once per prompt (vLLM's per-prompt requests): its
        ``n`` and the most tokens one of the prompt's samples generated."""
        for most in max_output_tokens:
            self.request_params_n.observe(n)
            if self.request_max_num_generation_tokens is not None:
                self.request_max_num_generation_tokens.observe(most)

    def observe_rejection(self, reason: str) -> None:
        """``reason``: one of ADMISSION_REASONS."""
        self._admission_rejections.labels(self._model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # -- the log line -----------------------------------------------------------------

    def log_line(self) -> str | None:
        """vLLM's periodic line; None when nothing happened since the last one."""
        now = time.monotonic()
        with self._lock:
            prompt, gen = self._num_prompt_tokens, self._num_generation_tokens
        t0, prompt0, gen0 = self._last_log
        s = self.snapshot
        if prompt == prompt0 and gen == gen0 and s.num_running == 0 and s.num_waiting == 0:
            self._last_log = (now, prompt, gen)
            return None
        dt = max(now - t0, 1e-9)
        self._last_log = (now, prompt, gen)
        hit_rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        return (
            f"Avg prompt throughput: {(prompt - prompt0) / dt:.1f} tokens/s, "
            f"Avg generation throughput: {(gen - gen0) / dt:.1f} tokens/s, "
            f"Running: {s.num_running} reqs, Waiting: {s.num_waiting} reqs, "
            f"KV cache usage: {100 * s.kv_cache_usage:.1f}%, "
            f"Prefix cache hit rate: {100 * hit_rate:.1f}%, "
            f"Preemptions: {s.num_preemptions}"
        )


def parse_metrics(text: str) -> dict[str, float]:
    """Every sample of a /metrics body, keyed ``name{label=value,...}`` (labels sorted,
    ``model_name`` and ``engine`` left out): what a client scraping /metrics compares."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                              if k not in ("model_name", "engine"))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out
