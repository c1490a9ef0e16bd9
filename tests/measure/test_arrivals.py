"""The arrival generator: Poisson gaps have the right mean, burstiness moves the variance."""

from __future__ import annotations

import math

import numpy as np
import pytest

from iterserve.bench.datasets import SampleRequest
from iterserve.bench.serve import BenchConfig, schedule_offsets
from iterserve.measure.arrivals import arrival_gaps, arrival_times

N = 40_000


def test_poisson_gaps_mean_and_cv():
    gaps = arrival_gaps(N + 1, rate=8.0, burstiness=1.0, seed=0)
    assert len(gaps) == N
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.03)
    # Exponential gaps: standard deviation equals the mean (coefficient of variation 1).
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_burstiness_keeps_mean_changes_variance(burstiness):
    rate = 5.0
    gaps = arrival_gaps(N + 1, rate, burstiness, seed=1)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.04)
    # Gamma(k, 1/(rate k)): variance 1 / (rate^2 k).
    assert gaps.var() == pytest.approx(1 / (rate**2 * burstiness), rel=0.1)


def test_burstier_means_more_variance():
    var = {
        k: arrival_gaps(N, 10.0, k, seed=2).var() for k in (0.5, 1.0, 2.0)
    }
    assert var[0.5] > 1.5 * var[1.0] > 2.25 * var[2.0]


def test_infinite_rate_and_infinite_burstiness():
    assert np.all(arrival_gaps(10, math.inf) == 0)
    assert np.allclose(arrival_gaps(10, 4.0, math.inf), 0.25)


def test_seeded_and_starts_at_zero():
    a = arrival_times(100, "gamma", 3.0, 1.0, seed=7)
    b = arrival_times(100, "poisson", 3.0, seed=7)  # Poisson is gamma with shape 1
    c = arrival_times(100, "gamma", 3.0, 1.0, seed=8)
    assert a[0] == 0.0 and len(a) == 100
    assert np.array_equal(arrival_times(50, "gamma", 3.0, 1.0, seed=7), a[:50])
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert np.all(np.diff(a) >= 0)


@pytest.mark.parametrize("rate,burstiness", [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)])
def test_bad_parameters(rate, burstiness):
    with pytest.raises(ValueError):
        arrival_gaps(5, rate, burstiness)


def test_schedule_offsets_trace_vs_rate():
    reqs = [SampleRequest("x", 1, 1, arrival_time=t) for t in (0.0, 0.5, 2.0)]
    assert list(schedule_offsets(reqs, BenchConfig())) == [0.0, 0.5, 2.0]
    # An explicit rate replaces the trace's timestamps.
    offsets = schedule_offsets(reqs, BenchConfig(request_rate=100.0))
    assert offsets[0] == 0.0 and offsets[-1] < 1.0
    plain = [SampleRequest("x", 1, 1) for _ in range(4)]
    assert list(schedule_offsets(plain, BenchConfig())) == [0.0] * 4
