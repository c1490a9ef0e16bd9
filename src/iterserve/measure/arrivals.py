"""Request arrival times: Poisson, gamma (burstiness), all at once.

Gaps between arrivals are gamma-distributed with shape ``burstiness`` and mean
``1 / rate``, as in ``vllm bench serve``: burstiness 1 is a Poisson process
(exponential gaps), below 1 burstier (variance ``1 / (rate^2 * k)`` grows),
above 1 more regular, and ``inf`` a constant gap. An infinite rate (or
``all-at-once``) puts every arrival at 0. Trace arrivals are the trace's
(:func:`iterserve.measure.traces.trace_arrivals`).
"""

from __future__ import annotations

import math

import numpy as np

from iterserve.measure.streams import stream

ARRIVALS = ("poisson", "gamma", "all-at-once", "trace")


def arrival_times(
    num_requests: int,
    kind: str = "poisson",
    rate: float = 1.0,
    burstiness: float = 1.0,
    seed: int | None = 0,
) -> np.ndarray:
    """Arrival offsets in seconds, the first at 0, from ``seed``'s arrival stream.

    One gap is drawn per request and the first one is dropped, so ``n`` arrivals
    are a prefix of ``n + 1`` for the same seed.
    """
    kind = kind.lower().replace("_", "-")
    n = num_requests
    if kind in ("all-at-once", "burst", "offline"):
        return np.zeros(n)
    if kind not in ("poisson", "gamma"):
        raise ValueError(f"arrival must be one of {', '.join(ARRIVALS[:3])}, got {kind!r}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0 (or inf) for {kind} arrivals, got {rate}")
    k = 1.0 if kind == "poisson" else burstiness
    if not k > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return np.zeros(n)
    if math.isinf(k):
        gaps = np.full(n, 1.0 / rate)
    else:
        # Poisson is shape 1, which numpy draws as the exponential itself.
        gaps = stream(seed, "arrival").gamma(k, 1.0 / (rate * k), size=n)
    if n:
        gaps[0] = 0.0
    return np.cumsum(gaps)


def arrival_gaps(
    num_requests: int, rate: float, burstiness: float = 1.0, seed: int | None = 0
) -> np.ndarray:
    """The ``num_requests - 1`` gaps between consecutive gamma arrivals."""
    return np.diff(arrival_times(num_requests, "gamma", rate, burstiness, seed))
