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


RAMP_UP_STRATEGIES = ("linear", "exponential")


def ramp_up_rates(
    num_requests: int, strategy: str, start_rps: float, end_rps: float
) -> np.ndarray:
    """Request ``i``'s rate going from ``start_rps`` to ``end_rps`` over the run, as
    ``vllm bench serve --ramp-up-strategy`` does: linear in ``i / (n - 1)``, or
    exponential (``start * (end / start) ** (i / (n - 1))``)."""
    if strategy not in RAMP_UP_STRATEGIES:
        raise ValueError(f"ramp_up_strategy must be one of {RAMP_UP_STRATEGIES}, got {strategy!r}")
    if start_rps < 0 or end_rps < 0:
        raise ValueError("ramp_up_start_rps and ramp_up_end_rps must be >= 0")
    if start_rps > end_rps:
        raise ValueError(
            f"ramp_up_start_rps ({start_rps}) must be <= ramp_up_end_rps ({end_rps})")
    if not end_rps > 0:
        raise ValueError("ramp_up_end_rps must be > 0")
    progress = np.arange(num_requests) / max(num_requests - 1, 1)
    if strategy == "linear":
        return start_rps + (end_rps - start_rps) * progress
    if not start_rps > 0:
        raise ValueError("an exponential ramp-up needs ramp_up_start_rps > 0")
    return start_rps * (end_rps / start_rps) ** progress


def ramp_up_arrival_times(
    num_requests: int,
    strategy: str,
    start_rps: float,
    end_rps: float,
    burstiness: float = 1.0,
    seed: int | None = 0,
) -> np.ndarray:
    """Arrival offsets (the first at 0) whose gap before request ``i`` is gamma with
    mean ``1 / rate_i`` (:func:`ramp_up_rates`); with ``start == end`` these are
    :func:`arrival_times`' gamma arrivals for the same seed."""
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    rates = ramp_up_rates(num_requests, strategy, start_rps, end_rps)
    if math.isinf(burstiness):
        unit = np.ones(num_requests)
    else:
        unit = stream(seed, "arrival").gamma(burstiness, 1.0 / burstiness, size=num_requests)
    gaps = np.zeros(num_requests)
    # The first gap is dropped (its rate may be 0 on a linear ramp from 0).
    gaps[1:] = unit[1:] / rates[1:]
    return np.cumsum(gaps)
