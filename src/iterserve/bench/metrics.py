"""Serving metrics from per-request records, the result table, the result file.

Definitions (client side, as ``vllm bench serve`` reports them):

- TTFT: send -> first streamed token.
- TPOT: ``(E2EL - TTFT) / (output_len - 1)`` per request, first token excluded;
  requests with a single output token have none.
- ITL: every gap between consecutive streamed chunks, all requests pooled.
- E2EL: send -> last byte.
- goodput: completed requests meeting every SLO given (``ttft``, ``tpot``,
  ``e2el`` in ms; a one-token request's TPOT counts as 0), per second.

Everything here works from :class:`RequestRecord` lists, so a simulated run
(``iterserve simulate``) that writes the same records gets the same numbers,
table and plots as a measured one.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

RESULT_SCHEMA = "iterserve.bench.result/v1"
METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")
_METRIC_TITLES = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


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
    priority: int | None = None
    tenant: str | None = None
    generated_text: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.output_len > 1:
            return (self.e2el - self.ttft) / (self.output_len - 1)
        return None

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
class MetricStats:
    mean: float
    median: float
    std: float
    percentiles: list[tuple[float, float]]  # (p, value), ms


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
    slos: dict[str, float] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = float("nan")
        if not sep or math.isnan(ms):
            raise ValueError(f"--goodput wants KEY:MILLISECONDS pairs (e.g. ttft:200), got {pair!r}")
        if name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput metric must be one of ttft, tpot, e2el; got {name!r}")
        if ms < 0:
            raise ValueError(f"--goodput {name} must be >= 0 ms, got {ms}")
        slos[name] = ms
    return slos


def parse_float_list(spec: str) -> list[float]:
    return [float(x) for x in spec.split(",") if x.strip()]


def meets_slos(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    values = {"ttft": record.ttft, "tpot": record.tpot or 0.0, "e2el": record.e2el}
    return all(values[name] * 1000.0 <= slo for name, slo in slos_ms.items())


def _stats(values: list[float], percentiles: list[float]) -> MetricStats:
    arr = np.asarray(values if values else [0.0]) * 1000.0
    return MetricStats(
        mean=float(arr.mean()),
        median=float(np.median(arr)),
        std=float(arr.std()),
        percentiles=[(p, float(np.percentile(arr, p))) for p in percentiles],
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
    good = sum(meets_slos(r, goodput_slos_ms) for r in ok) if goodput_slos_ms else 0
    values = {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [gap for r in ok for gap in r.itls],
        "e2el": [r.e2el for r in ok],
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
        stats={name: _stats(v, percentiles) for name, v in values.items()},
    )


def _p_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def summary_dict(
    m: BenchmarkMetrics, goodput_slos_ms: dict[str, float] | None = None
) -> dict[str, Any]:
    """The summary under vLLM's key names (``mean_ttft_ms``, ``p99_ttft_ms``, ...).

    Every metric goes in; ``--percentile-metrics`` only picks what is printed.
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


def build_result(
    records: list[RequestRecord],
    metrics: BenchmarkMetrics,
    config: dict[str, Any],
    *,
    goodput_slos_ms: dict[str, float] | None = None,
    save_detailed: bool = False,
) -> dict[str, Any]:
    """The JSON result: run config + vLLM-named summary + per-request records.

    Also carries vLLM's per-request arrays (``input_lens``, ``output_lens``,
    ``ttfts``, ``latencies``, ``errors``) so tools written for vLLM's files read it.
    """
    result: dict[str, Any] = {"schema": RESULT_SCHEMA, **config}
    result["goodput_config"] = goodput_slos_ms or None
    result.update(summary_dict(metrics, goodput_slos_ms=goodput_slos_ms))
    result["input_lens"] = [r.prompt_len for r in records]
    result["output_lens"] = [r.output_len if r.success else 0 for r in records]
    result["ttfts"] = [r.ttft for r in records]
    result["latencies"] = [r.e2el for r in records]
    result["errors"] = [r.error for r in records]
    result["records"] = [r.to_json(with_text=save_detailed) for r in records]
    return result


def save_result(result: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1, allow_nan=False, default=_json_default)
    return path


def _json_default(o: Any) -> Any:
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def load_result(path: str | Path) -> dict[str, Any]:
    """A result file (ours, the simulator's, or vLLM's), with ``records`` always present.

    vLLM's files carry parallel arrays instead of records; records are rebuilt
    from them (ITL lists when saved, no arrival times: those read as 0).
    """
    with open(path, encoding="utf-8") as f:
        result = json.load(f)
    if not isinstance(result, dict):
        raise ValueError(f"{path}: not a benchmark result (want a JSON object)")
    if "records" not in result:
        n = len(result.get("ttfts") or [])
        if not n:
            raise ValueError(f"{path}: no per-request data (records or ttfts)")
        itls = result.get("itls") or [[] for _ in range(n)]
        errors = result.get("errors") or [""] * n
        starts = result.get("start_times") or [0.0] * n
        result["records"] = [
            RequestRecord(
                arrival_time=0.0, send_time=float(starts[i] - (min(starts) if starts else 0.0)),
                prompt_len=int(result.get("input_lens", [0] * n)[i] or 0),
                output_len=int(result.get("output_lens", [0] * n)[i] or 0),
                ttft=float(result["ttfts"][i] or 0.0), itls=list(itls[i] or []),
                e2el=float(result.get("latencies", [0.0] * n)[i] or 0.0),
                success=not errors[i], error=errors[i] or "",
            ).to_json()
            for i in range(n)
        ]
    return result


def load_results(path: str | Path) -> list[dict[str, Any]]:
    """Every run in a file: one for ``bench serve`` / vLLM files, one per run for
    ``iterserve simulate`` files (``{"runs": [{label, metrics, records}, ...]}``,
    saved with ``--save-records``)."""
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    if not (isinstance(doc, dict) and isinstance(doc.get("runs"), list)):
        return [load_result(path)]
    runs = []
    for i, run in enumerate(doc["runs"]):
        if "records" not in run:
            raise ValueError(f"{path}: run {i} has no records (simulate with --save-records)")
        metrics = run.get("metrics") or {}
        runs.append({
            "source": "simulated",
            "label": run.get("label") or f"{Path(path).stem}[{i}]",
            "records": run["records"],
            "request_throughput": metrics.get("request_throughput"),
            "output_throughput": metrics.get("output_token_throughput"),
            "failed": 0,
        })
    return runs


def records_of(result: dict[str, Any]) -> list[RequestRecord]:
    return [RequestRecord.from_json(d) for d in result["records"]]
