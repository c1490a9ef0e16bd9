"""Benchmark result files: run config + summary + per-request records, and reading
them back (ours, the simulator's ``--save-records`` files, or vLLM's)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from iterserve.bench.metrics import METRIC_NAMES, BenchmarkMetrics, RequestRecord, summary_dict

RESULT_SCHEMA = "iterserve.bench.result/v1"


def build_result(
    records: list[RequestRecord],
    metrics: BenchmarkMetrics,
    config: dict[str, Any],
    *,
    goodput_slos_ms: dict[str, float] | None = None,
    save_detailed: bool = False,
    percentile_metrics: tuple[str, ...] | list[str] = METRIC_NAMES,
) -> dict[str, Any]:
    """The JSON result: run config + vLLM-named summary + per-request records.

    The statistics written are those of ``percentile_metrics`` (vLLM's
    ``--percentile-metrics``). Also carries vLLM's per-request arrays (``input_lens``,
    ``output_lens``, ``ttfts``, ``latencies``, ``errors``, ``queue_times``, and with
    ``save_detailed`` ``itls``, ``start_times`` (seconds since the run's start) and
    ``generated_texts``) so tools written for vLLM's files read it.
    """
    result: dict[str, Any] = {"schema": RESULT_SCHEMA, **config}
    result["goodput_config"] = goodput_slos_ms or None
    result.update(summary_dict(metrics, goodput_slos_ms=goodput_slos_ms,
                               percentile_metrics=percentile_metrics))
    result["input_lens"] = [r.prompt_len for r in records]
    result["output_lens"] = [r.output_len if r.success else 0 for r in records]
    result["ttfts"] = [r.ttft for r in records]
    result["latencies"] = [r.e2el for r in records]
    result["errors"] = [r.error for r in records]
    # Client-side wait before sending (max_concurrency), as vLLM's queue_times.
    result["queue_times"] = [max(r.send_time - r.arrival_time, 0.0) for r in records]
    if save_detailed:
        result["itls"] = [list(r.itls) for r in records]
        result["start_times"] = [r.send_time for r in records]
        result["generated_texts"] = [r.generated_text or "" for r in records]
    result["records"] = [r.to_json(with_text=save_detailed) for r in records]
    return result


def save_result(result: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_clean(result), f, indent=1, allow_nan=False, default=_json_default)
    return path


def _clean(o: Any) -> Any:
    """NaN (a statistic with no data) -> null, so the file is strict JSON."""
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [_clean(v) for v in o]
    if isinstance(o, float) and math.isnan(o):
        return None
    return o


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
