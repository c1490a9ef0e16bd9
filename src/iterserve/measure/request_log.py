"""Per-request records on the engine's clock, and the summary a simulation is compared with.

A record is one finished request (a child: one sample of one prompt) as the engine
timed it (``engine/output_processor.py``): arrival, first scheduled, first token,
last token and finish times, with the durations derived from them (``latency.py``'s
definitions) and its token counts. ``iterserve serve --request-log PATH`` writes one
JSON line per record; ``iterserve calibrate --validate`` summarises the in-process
engine's records the same way. Measured on the server, these leave out what a
client adds (the network, chunks held back while text is undecidable, the client's
own CPU), so a difference from the simulation is the simulator's.

Nothing here imports torch, HTTP or a clock: the caller writes (``RequestLog``).
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

from iterserve.measure.latency import RequestMetrics

__all__ = ["RequestLog", "read_request_log", "request_record", "summarize_records"]


def request_record(request_id: str, finish_reason: str | None, m: RequestMetrics
                   ) -> dict[str, Any]:
    """One finished request's record: absolute times (the engine's monotonic clock,
    seconds) and durations (seconds; None where a phase was not reached)."""
    return {
        "request_id": request_id,
        "finish_reason": finish_reason,
        "arrival_time": m.arrival_time,
        "first_scheduled_time": m.first_scheduled_time,
        "first_token_time": m.first_token_time,
        "last_token_time": m.last_token_time,
        "finished_time": m.finished_time,
        "queue_time": m.queue_time,
        "ttft": m.ttft,
        "tpot": m.tpot,
        "itl_mean": m.itl_mean,
        "e2e": m.e2e_latency,
        "num_prompt_tokens": m.num_prompt_tokens,
        "num_output_tokens": m.num_output_tokens,
        "num_token_outputs": m.num_token_outputs,
        "num_cached_tokens": m.num_cached_tokens,
        "num_preemptions": m.num_preemptions,
    }


class RequestLog:
    """Appends records to a JSON-lines file, one line per finished request, each
    flushed as written (a crash loses none that ended). Thread-safe."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._file: IO[str] | None = self.path.open("a", buffering=1)

    def write(self, request_id: str, finish_reason: str | None, m: RequestMetrics) -> None:
        line = json.dumps(request_record(request_id, finish_reason, m))
        with self._lock:
            if self._file is not None:
                self._file.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_request_log(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a request log (blank lines skipped)."""
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not a JSON record ({e.msg})") from None
    return out


def _col(records: Sequence[dict[str, Any]], key: str) -> np.ndarray:
    return np.array([math.nan if r.get(key) is None else float(r[key]) for r in records],
                    dtype=np.float64)


def summarize_records(records: Iterable[dict[str, Any]],
                      itls: Sequence[float] | None = None) -> dict[str, float]:
    """The compared metrics of a run's records: output throughput (tok/s, first
    arrival to last finish), mean and p90 TTFT, mean ITL, mean TPOT and mean E2E (ms).

    ITL is the mean of every gap between two token-bearing outputs: ``itls`` when the
    caller has each gap, else from each record's first-to-last token time and output
    count (the same mean, weighted by gaps)."""
    recs = [r for r in records if r.get("finish_reason") not in ("abort", "error")]
    if not recs:
        raise ValueError("no finished requests to summarise")
    arrival, finished = _col(recs, "arrival_time"), _col(recs, "finished_time")
    duration = max(float(np.nanmax(finished) - np.nanmin(arrival)), 1e-12)
    ttft = _col(recs, "ttft") * 1e3
    if itls is not None:
        itl = float(np.mean(itls)) * 1e3 if len(itls) else math.nan
    else:
        span = _col(recs, "last_token_time") - _col(recs, "first_token_time")
        gaps: np.ndarray = _col(recs, "num_token_outputs") - 1
        ok = gaps > 0
        itl = float(np.nansum(span[ok]) / gaps[ok].sum() * 1e3) if ok.any() else math.nan
    return {
        "num_requests": float(len(recs)),
        "duration_s": duration,
        "output_throughput": float(sum(r["num_output_tokens"] for r in recs)) / duration,
        "ttft_mean_ms": float(np.nanmean(ttft)),
        "ttft_p90_ms": float(np.nanpercentile(ttft, 90)),
        "itl_mean_ms": itl,
        "tpot_mean_ms": _nanmean(_col(recs, "tpot") * 1e3),
        "e2e_mean_ms": float(np.nanmean(_col(recs, "e2e") * 1e3)),
    }


def _nanmean(x: np.ndarray) -> float:
    return float(np.nanmean(x)) if np.isfinite(x).any() else math.nan
