"""Workloads: seeded arrivals x length distributions, traces, synthetic prompts."""

from __future__ import annotations

import numpy as np
import pytest

from iterserve.measure.traces import trace_path
from iterserve.sim.workload import (
    LogNormal,
    RequestSpec,
    load_trace,
    make_workload,
    parse_length_dist,
    prompt_token_ids,
)

TRACE = trace_path("splitwise_conv")  # shipped with the package


def test_seeded_and_reproducible():
    a = make_workload(200, rate=5.0, seed=3)
    b = make_workload(200, rate=5.0, seed=3)
    c = make_workload(200, rate=5.0, seed=4)
    assert a.requests == b.requests
    assert a.requests != c.requests


def test_poisson_rate_and_gamma_burstiness():
    n = 20000
    p = make_workload(n, arrival="poisson", rate=10.0, seed=0)
    assert p.arrival_rate == pytest.approx(10.0, rel=0.03)
    gaps = np.diff([r.arrival_time for r in p.requests])
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    g = make_workload(n, arrival="gamma", rate=10.0, burstiness=0.25, seed=0)
    assert g.arrival_rate == pytest.approx(10.0, rel=0.05)
    gaps = np.diff([r.arrival_time for r in g.requests])
    # Gamma with shape k has CV 1/sqrt(k): burstiness 0.25 -> CV 2.
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(2.0, rel=0.1)
    assert all(r.arrival_time == 0 for r in make_workload(10, arrival="all-at-once").requests)


def test_length_distributions():
    rng = np.random.default_rng(0)
    assert (parse_length_dist("fixed:7").sample(rng, 5) == 7).all()
    u = parse_length_dist("uniform:3:9").sample(rng, 1000)
    assert u.min() == 3 and u.max() == 9
    ln = parse_length_dist("lognormal:200:1.0").sample(rng, 50000)
    assert ln.mean() == pytest.approx(200, rel=0.05)
    assert np.percentile(ln, 99) > 5 * np.median(ln)  # heavy tail
    assert parse_length_dist("lognormal:200:2:1000").sample(rng, 1000).max() <= 1000
    assert isinstance(parse_length_dist("lognormal:10:0.5"), LogNormal)
    assert parse_length_dist("pareto:10:1.5").sample(rng, 100).min() >= 10
    assert parse_length_dist("trace") is None
    for bad in ("uniform:9:3", "gauss:1", "lognormal:x:1", "fixed"):
        with pytest.raises(ValueError, match="bad length distribution"):
            parse_length_dist(bad)


def test_splitwise_trace():
    rows = load_trace(TRACE)
    assert len(rows) == 19366
    assert rows[0] == RequestSpec(0.0, 374, 44)
    assert np.mean([r.prompt_len for r in rows]) == pytest.approx(1155, rel=0.01)
    # Trace lengths with its own arrivals, or with Poisson arrivals at a chosen rate.
    wl = make_workload(100, arrival="trace", prompt_len="trace", output_len="trace", trace=TRACE)
    assert [r.prompt_len for r in wl.requests] == [r.prompt_len for r in rows[:100]]
    assert wl.requests[3].arrival_time == pytest.approx(rows[3].arrival_time)
    fast = make_workload(100, arrival="trace", prompt_len="trace", output_len="trace",
                         trace=TRACE, time_scale=0.0, rate=50.0)
    assert fast.arrival_rate == pytest.approx(50.0)
    pois = make_workload(1000, arrival="poisson", rate=3.0, prompt_len="trace",
                         output_len="fixed:10", trace=TRACE, seed=1)
    assert all(r.output_len == 10 for r in pois.requests)
    assert pois.mean_prompt_len == pytest.approx(1155, rel=0.15)


def test_jsonl_roundtrip(tmp_path):
    wl = make_workload(50, rate=2.0, seed=0)
    wl.requests[0].priority, wl.requests[1].tenant = 3, "b"
    wl.requests[2].prefix_group, wl.requests[2].prefix_len = 1, 64
    path = tmp_path / "w.jsonl"
    wl.to_jsonl(path)
    back = make_workload(arrival="trace", prompt_len="trace", output_len="trace", trace=path)
    assert back.requests == wl.requests


def test_prompt_ids_unique_and_shared_prefix():
    a = prompt_token_ids(RequestSpec(0, 100, 1), 0)
    b = prompt_token_ids(RequestSpec(0, 100, 1), 1)
    assert len(a) == len(b) == 100 and a[:16] != b[:16]
    g1 = prompt_token_ids(RequestSpec(0, 100, 1, prefix_group=5, prefix_len=48), 0)
    g2 = prompt_token_ids(RequestSpec(0, 80, 1, prefix_group=5, prefix_len=48), 1)
    assert g1[:48] == g2[:48] and g1[48:64] != g2[48:64]
    assert len(prompt_token_ids(RequestSpec(0, 1, 1), 7)) == 1
