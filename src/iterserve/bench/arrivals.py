"""Request arrival times: Poisson, gamma (burstiness), all at once, or a trace's.

Gaps between arrivals are gamma-distributed with shape ``burstiness`` and mean
``1 / request_rate``, as in ``vllm bench serve``: burstiness 1 is a Poisson
process (exponential gaps), below 1 burstier (variance ``1 / (rate^2 * k)``
grows), above 1 more regular, and ``inf`` a constant gap.
"""

from __future__ import annotations

import math

import numpy as np


def arrival_gaps(
    num_requests: int,
    request_rate: float,
    burstiness: float = 1.0,
    rng: np.random.Generator | None = None,
) -> np.ndarray:
    """``num_requests - 1`` gaps in seconds between consecutive arrivals."""
    if request_rate <= 0:
        raise ValueError(f"request_rate must be > 0 (or inf), got {request_rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    n = max(num_requests - 1, 0)
    if math.isinf(request_rate):
        return np.zeros(n)
    if math.isinf(burstiness):
        return np.full(n, 1.0 / request_rate)
    rng = rng if rng is not None else np.random.default_rng()
    theta = 1.0 / (request_rate * burstiness)  # mean = shape * scale = 1 / rate
    return rng.gamma(shape=burstiness, scale=theta, size=n)


def arrival_times(
    num_requests: int,
    request_rate: float,
    burstiness: float = 1.0,
    seed: int | None = 0,
) -> np.ndarray:
    """Arrival offsets from the start in seconds; the first request arrives at 0."""
    gaps = arrival_gaps(num_requests, request_rate, burstiness, np.random.default_rng(seed))
    return np.concatenate([[0.0], np.cumsum(gaps)])[:num_requests]
