"""Latency statistics and goodput over many requests (docs/metrics.md).

- Statistics of a latency are over the requests where it is defined (TPOT leaves
  out one-token requests; ITL pools every gap of every request); milliseconds;
  percentiles by linear interpolation (``numpy.percentile``, as vLLM); NaN when no
  request has a value.
- Goodput: completed requests meeting every SLO given, per second of the run.
  SLOs are in milliseconds on ``ttft``, ``tpot`` and ``e2e`` (``e2el`` is vLLM's
  name for it); a one-token request's TPOT counts as 0; a value equal to its SLO
  meets it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from iterserve.measure.latency import RequestLatencies

# The percentiles every summary carries besides the median (the simulator's table).
SUMMARY_PERCENTILES = (90.0, 99.0)
SLO_METRICS = ("ttft", "tpot", "e2e")
_SLO_ALIASES = {"e2el": "e2e"}


def percentile_name(p: float) -> str:
    """99.0 -> "p99", 99.9 -> "p99.9"."""
    return f"p{int(p)}" if int(p) == p else f"p{p}"


@dataclass(slots=True)
class LatencyStats:
    """One latency's distribution, in milliseconds."""

    count: int
    mean: float
    median: float
    std: float
    percentiles: list[tuple[float, float]]  # (p, value)

    def percentile(self, p: float) -> float:
        for q, v in self.percentiles:
            if q == p:
                return v
        raise KeyError(f"percentile {p} was not computed (have {[q for q, _ in self.percentiles]})")

    def as_dict(self) -> dict[str, float]:
        """``{"mean", "median", "p90", "p99", ...}``: the simulator's metrics shape."""
        d = {"mean": self.mean, "median": self.median}
        d.update({percentile_name(p): v for p, v in self.percentiles})
        return d


def latency_stats(
    values_s: Sequence[float] | np.ndarray, percentiles: Sequence[float] = SUMMARY_PERCENTILES
) -> LatencyStats:
    """Statistics of latencies given in seconds (NaN entries are left out), in ms."""
    a = np.asarray(values_s, dtype=np.float64)
    a = a[~np.isnan(a)] * 1e3
    if not len(a):
        nan = math.nan
        return LatencyStats(0, nan, nan, nan, [(float(p), nan) for p in percentiles])
    q = np.percentile(a, [50.0, *percentiles])
    return LatencyStats(
        count=len(a), mean=float(a.mean()), median=float(q[0]), std=float(a.std()),
        percentiles=[(float(p), float(v)) for p, v in zip(percentiles, q[1:])],
    )


def normalize_slos(slos_ms: dict[str, float] | None) -> dict[str, float]:
    """Check SLO names and values; ``e2el`` becomes ``e2e``."""
    out: dict[str, float] = {}
    for name, ms in (slos_ms or {}).items():
        key = _SLO_ALIASES.get(name, name)
        if key not in SLO_METRICS:
            raise ValueError(f"goodput SLO metric must be one of ttft, tpot, e2el; got {name!r}")
        if not ms >= 0:  # also NaN
            raise ValueError(f"goodput SLO {name} must be >= 0 ms, got {ms}")
        out[key] = float(ms)
    return out


def parse_slos(pairs: Sequence[str] | None) -> dict[str, float]:
    """``["ttft:200", "tpot:50"]`` -> ``{"ttft": 200.0, "tpot": 50.0}`` (ms); vLLM's
    ``--goodput`` syntax. Names are kept as given (``e2el`` stays ``e2el``)."""
    slos: dict[str, float] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = math.nan
        if not sep or math.isnan(ms):
            raise ValueError(f"--goodput wants KEY:MILLISECONDS pairs (e.g. ttft:200), got {pair!r}")
        normalize_slos({name: ms})
        slos[name] = ms
    return slos


def meets_slos(lat: RequestLatencies, slos_ms: dict[str, float] | None) -> np.ndarray:
    """Per request: finished and within every SLO (a missing TPOT counts as 0)."""
    ok = ~np.isnan(lat.e2e)
    for name, ms in normalize_slos(slos_ms).items():
        v = getattr(lat, name)
        if name == "tpot":
            v = np.where(np.isnan(v), 0.0, v)
        ok &= v * 1e3 <= ms
    return ok


def goodput(lat: RequestLatencies, slos_ms: dict[str, float] | None, duration_s: float) -> float:
    """Requests meeting every SLO per second of a run lasting ``duration_s``."""
    return float(meets_slos(lat, slos_ms).sum()) / max(duration_s, 1e-12)
