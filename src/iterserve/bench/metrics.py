"""Serving metrics from per-request records, and the result table.

The definitions (TTFT, TPOT, ITL, E2E, goodput) are :mod:`iterserve.measure`'s,
the same the simulator, ``LLM`` and ``/metrics`` use (docs/metrics.md). Client
side, as ``vllm bench serve`` measures them: TTFT and E2EL are from the request's
send, ITL is every gap between streamed chunks that carry tokens.

Everything here works from :class:`RequestRecord` lists, so a simulated run
(``iterserve simulate --save-records``) gets the same numbers, table and plots
as a measured one.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from iterserve.measure.latency import RequestLatencies, time_per_output_token
from iterserve.measure.summary import LatencyStats, latency_stats, meets_slos, parse_slos

METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")
_METRIC_TITLES = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}
# The statistics of one metric (ms); the name vLLM's bench uses.
MetricStats = LatencyStats


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it. Times in seconds; offsets from the run's start."""

    arrival_time: float  # when the workload said it arrives
    send_time: float  # when it was sent (later than arrival when max_concurrency holds it back)
    prompt_len: int
    output_len: int  # output tokens received (usage, else tokenizer, else chunk count)
    expected_output_len: int = 0  # max_tokens asked
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    e2el: float = 0.0
    success: bool = True
    error: str = ""
    error_code: str = ""  # HTTP status ("429", "500"), "connection", "timeout", "stream"
    retries: int = 0  # resends after a reused keep-alive connection closed unanswered
    priority: int | None = None
    tenant: str | None = None
    generated_text: str | None = None

    @property
    def tpot(self) -> float | None:
        return time_per_output_token(self.ttft, self.e2el, self.output_len)

    def to_json(self, with_text: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not with_text:
            d.pop("generated_text")
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RequestRecord:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(slots=True)
class BenchmarkMetrics:
    completed: int
    failed: int
    num_rate_limited: int  # 429s, also counted in failed
    errors_by_code: dict[str, int]
    total_input: int
    total_output: int
    good_completed: int
    duration: float
    request_throughput: float
    request_goodput: float
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    stats: dict[str, MetricStats]  # "ttft" | "tpot" | "itl" | "e2el" -> ms statistics


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """``["ttft:200", "tpot:50"]`` -> ``{"ttft": 200.0, "tpot": 50.0}`` (milliseconds)."""
    return parse_slos(pairs)


def parse_float_list(spec: str) -> list[float]:
    return [float(x) for x in spec.split(",") if x.strip()]


def latencies_of(records: list[RequestRecord]) -> RequestLatencies:
    """The latency columns of ``records`` (successful or not: select before use)."""
    return RequestLatencies.from_durations(
        [r.ttft for r in records], [r.e2el for r in records], [r.output_len for r in records]
    )


def _peaks(ok: list[RequestRecord]) -> tuple[float, int]:
    """Most output tokens in any one-second bucket, and the most requests in flight."""
    if not ok:
        return 0.0, 0
    t0 = min(r.send_time for r in ok)
    t_end = max(r.send_time + r.e2el for r in ok)
    buckets = np.zeros(math.ceil(t_end - t0) + 1)
    events = []
    for r in ok:
        t = r.send_time + r.ttft
        times = [t]
        for gap in r.itls:
            t += gap
            times.append(t)
        idx = np.clip(((np.asarray(times) - t0)).astype(int), 0, len(buckets) - 1)
        np.add.at(buckets, idx, 1)
        events += [(r.send_time, 1), (r.send_time + r.e2el, -1)]
    events.sort()  # at equal times a departure (-1) sorts before an arrival
    peak = cur = 0
    for _, delta in events:
        cur += delta
        peak = max(peak, cur)
    return float(buckets.max()), peak


def calculate_metrics(
    records: list[RequestRecord],
    duration: float,
    percentiles: list[float] | None = None,
    goodput_slos_ms: dict[str, float] | None = None,
) -> BenchmarkMetrics:
    """Summary metrics over a run of ``duration`` seconds."""
    percentiles = percentiles if percentiles is not None else [99.0]
    ok = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    codes = Counter(r.error_code or "unknown" for r in failed)
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_len for r in ok)
    lat = latencies_of(ok)
    good = int(meets_slos(lat, goodput_slos_ms).sum()) if goodput_slos_ms else 0
    values = {
        "ttft": lat.ttft,
        "tpot": lat.tpot,
        "itl": np.array([gap for r in ok for gap in r.itls], dtype=np.float64),
        "e2el": lat.e2e,
    }
    duration = max(duration, 1e-9)
    peak_tokens, peak_concurrency = _peaks(ok)
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(failed),
        num_rate_limited=codes.get("429", 0),
        errors_by_code=dict(sorted(codes.items())),
        total_input=total_input,
        total_output=total_output,
        good_completed=good,
        duration=duration,
        request_throughput=len(ok) / duration,
        request_goodput=good / duration,
        output_throughput=total_output / duration,
        total_token_throughput=(total_input + total_output) / duration,
        max_output_tokens_per_s=peak_tokens,
        max_concurrent_requests=peak_concurrency,
        stats={name: latency_stats(v, percentiles) for name, v in values.items()},
    )


def _p_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def summary_dict(
    m: BenchmarkMetrics,
    goodput_slos_ms: dict[str, float] | None = None,
    percentile_metrics: tuple[str, ...] | list[str] = METRIC_NAMES,
) -> dict[str, Any]:
    """The summary under vLLM's key names (``mean_ttft_ms``, ``p99_ttft_ms``, ...).

    The statistics of ``percentile_metrics`` go in (vLLM's ``--percentile-metrics``
    decides what is printed and written alike).
    """
    out: dict[str, Any] = {
        "duration": m.duration,
        "completed": m.completed,
        "failed": m.failed,
        "num_rate_limited": m.num_rate_limited,
        "errors_by_code": m.errors_by_code,
        "total_input_tokens": m.total_input,
        "total_output_tokens": m.total_output,
        "request_throughput": m.request_throughput,
        "request_goodput": m.request_goodput if goodput_slos_ms else None,
        "good_completed": m.good_completed if goodput_slos_ms else None,
        "output_throughput": m.output_throughput,
        "total_token_throughput": m.total_token_throughput,
        "max_output_tokens_per_s": m.max_output_tokens_per_s,
        "max_concurrent_requests": m.max_concurrent_requests,
    }
    for name in METRIC_NAMES:
        if name not in percentile_metrics:
            continue
        s = m.stats[name]
        out[f"mean_{name}_ms"] = s.mean
        out[f"median_{name}_ms"] = s.median
        out[f"std_{name}_ms"] = s.std
        for p, v in s.percentiles:
            out[f"p{_p_word(p)}_{name}_ms"] = v
    return out


def format_table(
    m: BenchmarkMetrics,
    *,
    max_concurrency: int | None = None,
    request_rate: float = math.inf,
    goodput_slos_ms: dict[str, float] | None = None,
    percentile_metrics: tuple[str, ...] | list[str] = ("ttft", "tpot", "itl"),
) -> str:
    """The result table in the layout ``vllm bench serve`` prints (50 columns)."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: Any, fmt: str = "") -> None:
        lines.append(f"{label:<40} {value:<10{fmt}}")

    row("Successful requests:", m.completed)
    row("Failed requests:", m.failed)
    if m.failed:
        row("Rate-limited requests (429):", m.num_rate_limited)
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency)
    if not math.isinf(request_rate):
        row("Request rate configured (RPS):", request_rate, ".2f")
    row("Benchmark duration (s):", m.duration, ".2f")
    row("Total input tokens:", m.total_input)
    row("Total generated tokens:", m.total_output)
    row("Request throughput (req/s):", m.request_throughput, ".2f")
    if goodput_slos_ms:
        row("Request goodput (req/s):", m.request_goodput, ".2f")
    row("Output token throughput (tok/s):", m.output_throughput, ".2f")
    row("Peak output token throughput (tok/s):", m.max_output_tokens_per_s, ".2f")
    row("Peak concurrent requests:", float(m.max_concurrent_requests), ".2f")
    row("Total token throughput (tok/s):", m.total_token_throughput, ".2f")
    for name in METRIC_NAMES:
        if name not in percentile_metrics:
            continue
        short, header = _METRIC_TITLES[name]
        s = m.stats[name]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {short} (ms):", s.mean, ".2f")
        row(f"Median {short} (ms):", s.median, ".2f")
        for p, v in s.percentiles:
            row(f"P{_p_word(p)} {short} (ms):", v, ".2f")
    if m.errors_by_code:
        lines.append("{s:{c}^{n}}".format(s="Failed Requests by Error Code", n=50, c="-"))
        for code, n in m.errors_by_code.items():
            row(f"{code}:", n)
    lines.append("=" * 50)
    return "\n".join(lines)


