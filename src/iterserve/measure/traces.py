"""Trace files: the shipped ones by name, and the rows of any CSV or JSONL trace.

A trace is a CSV with a header (the Splitwise / Vidur columns
``arrived_at,num_prefill_tokens,num_decode_tokens``) or a JSONL file, one object a
line, with ``arrival_time, prompt_len, output_len`` and optional ``priority,
tenant, prefix_group, prefix_len, max_tokens, prompt``. Each field is found under
any of the names in ``TRACE_KEYS`` (the simulator's, vLLM's and Splitwise's).

Shipped traces (``src/iterserve/data/traces``, source and licence in its README):
``splitwise_conv`` and ``splitwise_code``; ``trace_path("splitwise_conv")``
finds one by name.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

TRACES_DIR = Path(__file__).resolve().parent.parent / "data" / "traces"

# Names each field is read under, first match wins.
TRACE_KEYS: dict[str, tuple[str, ...]] = {
    "arrival_time": ("arrival_time", "arrived_at", "timestamp", "arrival"),
    "prompt_len": ("prompt_len", "num_prefill_tokens", "input_len", "prompt_tokens"),
    "output_len": ("output_len", "num_decode_tokens", "output_tokens", "max_tokens"),
}


def shipped_traces() -> list[str]:
    """Names of the traces that ship with iterserve."""
    return sorted(p.stem for p in TRACES_DIR.glob("*.csv"))


def trace_path(name_or_path: str | os.PathLike) -> Path:
    """An existing file as given, else a shipped trace by name (``splitwise_conv``)."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    for cand in (TRACES_DIR / p.name, TRACES_DIR / f"{p.name}.csv"):
        if p.parent == Path(".") and cand.is_file():
            return cand
    raise ValueError(
        f"trace {str(name_or_path)!r}: no such file, and not a shipped trace "
        f"(shipped: {', '.join(shipped_traces()) or 'none'})"
    )


def read_trace_rows(path: str | os.PathLike, limit: int | None = None) -> list[dict[str, Any]]:
    """Rows of a JSONL or CSV trace (a path or a shipped name), in file order."""
    path = trace_path(path)
    rows: list[dict[str, Any]] = []
    with open(path, encoding="utf-8", newline="") as f:
        if path.suffix.lower() == ".csv":
            for row in csv.DictReader(f):
                rows.append(row)
                if limit is not None and len(rows) >= limit:
                    break
        else:
            for lineno, line in enumerate(f, 1):
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not a JSON object: {e}") from None
                if limit is not None and len(rows) >= limit:
                    break
    return rows


def pick(row: dict[str, Any], field: str) -> Any:
    """``row``'s value for ``field`` under any of its names; None when absent or empty."""
    for key in TRACE_KEYS[field]:
        if key in row and row[key] not in (None, ""):
            return row[key]
    return None


def row_lengths(row: dict[str, Any], where: str) -> tuple[int, int]:
    """(prompt_len, output_len) of a row, each at least 1."""
    plen, olen = pick(row, "prompt_len"), pick(row, "output_len")
    if plen is None or olen is None:
        raise ValueError(
            f"{where}: needs a prompt length ({'/'.join(TRACE_KEYS['prompt_len'])}) "
            f"and an output length ({'/'.join(TRACE_KEYS['output_len'])})"
        )
    return max(1, int(float(plen))), max(1, int(float(olen)))


def trace_arrivals(times: np.ndarray, time_scale: float = 1.0, rate: float = 0.0) -> np.ndarray:
    """A trace's arrival times from 0, times ``time_scale``; ``time_scale`` 0 rescales
    them to the mean ``rate`` instead."""
    t = np.asarray(times, dtype=np.float64) - (times[0] if len(times) else 0.0)
    if time_scale > 0:
        return t * time_scale
    if len(t) > 1 and t[-1] > 0:
        if not rate > 0:
            raise ValueError(f"rescaling a trace to a rate needs rate > 0, got {rate}")
        t *= (len(t) - 1) / rate / t[-1]
    return t
