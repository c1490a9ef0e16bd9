"""The latency definitions on hand-made timings, and the same numbers from every user:
bench's summary, the simulator's summary, ``LLM``'s RequestMetrics and /metrics."""

from __future__ import annotations

import math

import numpy as np
import pytest

from iterserve.bench.metrics import RequestRecord, calculate_metrics
from iterserve.measure.latency import (
    RequestLatencies,
    RequestMetrics,
    inter_token_latencies,
    time_per_output_token,
)
from iterserve.measure.summary import goodput, latency_stats, meets_slos, parse_slos
from iterserve.metrics import Metrics
from iterserve.sim.simulator import SimResult, compute_metrics

# Hand-made requests: (arrival, first scheduled, times of each token-bearing output).
# Times are exact binary fractions so the arithmetic below is exact.
REQUESTS = [
    (0.0, 0.125, [0.5, 0.625, 0.75, 0.875, 1.0]),  # 5 tokens
    (0.25, 0.5, [1.0]),  # 1 token: no TPOT
    (0.5, 0.5, [0.75, 1.25, 1.75]),  # 3 tokens
    (1.0, 1.5, [2.0, 2.25]),  # 2 tokens
]


def test_per_request_definitions():
    m = RequestMetrics(arrival_time=0.0, first_scheduled_time=0.125, first_token_time=0.5,
                       finished_time=1.0, num_output_tokens=5)
    assert m.ttft == 0.5
    assert m.queue_time == 0.125
    assert m.e2e_latency == 1.0
    assert m.tpot == pytest.approx((1.0 - 0.5) / 4)  # the first token excluded
    assert m.decode_time is None  # the last token's time not given
    m.last_token_time = 1.0
    assert (m.prefill_time, m.decode_time, m.inference_time) == (0.375, 0.5, 0.875)
    one = RequestMetrics(0.25, 0.5, 1.0, 1.0, num_output_tokens=1)
    assert one.ttft == 0.75 and one.e2e_latency == 0.75 and one.tpot is None
    waiting = RequestMetrics(2.0, None, None, None)
    assert waiting.ttft is waiting.queue_time is waiting.e2e_latency is waiting.tpot is None
    assert time_per_output_token(0.1, 0.1, 0) is None
    # ITL: one value per output that carries tokens.
    assert inter_token_latencies([0.75, 1.25, 1.75]) == [0.5, 0.5]
    assert inter_token_latencies([1.0]) == []


def test_columns_and_statistics():
    lat = _latencies()
    assert lat.ttft.tolist() == [0.5, 0.75, 0.25, 1.0]
    assert lat.e2e.tolist() == [1.0, 0.75, 1.25, 1.25]
    assert lat.queue.tolist() == [0.125, 0.25, 0.0, 0.5]
    assert lat.tpot[[0, 2, 3]].tolist() == [0.125, 0.5, 0.25] and math.isnan(lat.tpot[1])
    s = latency_stats(lat.tpot, percentiles=[50, 99])
    assert s.count == 3  # the one-token request is left out
    assert s.mean == pytest.approx(1e3 * (0.125 + 0.5 + 0.25) / 3)
    assert s.median == pytest.approx(250.0) and s.percentile(50) == s.median
    assert s.percentile(99) == pytest.approx(1e3 * np.percentile([0.125, 0.5, 0.25], 99))
    empty = latency_stats([])
    assert empty.count == 0 and math.isnan(empty.mean) and math.isnan(empty.percentile(99))


def test_goodput_meets_every_slo_one_token_tpot_counts_as_zero():
    lat = _latencies()
    # ttft <= 750 ms drops request 3; tpot <= 250 ms drops request 2 (500 ms);
    # request 1 (one token) meets the TPOT SLO. Equality meets an SLO.
    slos = {"ttft": 750.0, "tpot": 250.0}
    assert meets_slos(lat, slos).tolist() == [True, True, False, False]
    assert goodput(lat, slos, duration_s=2.0) == pytest.approx(1.0)
    assert meets_slos(lat, {"e2el": 1000.0}).tolist() == [True, True, False, False]
    assert meets_slos(lat, None).all()
    unfinished = RequestLatencies.from_times(
        np.array([0.0]), np.array([0.1]), np.array([math.nan]), np.array([math.nan]), np.array([0])
    )
    assert not meets_slos(unfinished, {}).any()
    assert parse_slos(["ttft:200", "e2el:1000"]) == {"ttft": 200.0, "e2el": 1000.0}
    for bad in (["ttft"], ["ttft:x"], ["itl:5"], ["tpot:-1"]):
        with pytest.raises(ValueError):
            parse_slos(bad)


def test_bench_and_simulator_summaries_agree():
    slos = {"ttft": 750.0, "tpot": 250.0}
    records = [
        RequestRecord(arrival_time=a, send_time=a, prompt_len=10, output_len=len(t),
                      ttft=t[0] - a, itls=inter_token_latencies(t), e2el=t[-1] - a)
        for a, _, t in REQUESTS
    ]
    sim = _sim_result()
    sm = compute_metrics(sim, goodput=slos)
    duration = sm["duration_s"]
    assert duration == 2.25
    bm = calculate_metrics(records, duration, percentiles=[90, 99], goodput_slos_ms=slos)
    for bench_name, sim_name in (("ttft", "ttft_ms"), ("tpot", "tpot_ms"), ("itl", "itl_ms"),
                                 ("e2el", "e2e_ms")):
        b, s = bm.stats[bench_name], sm[sim_name]
        assert (b.mean, b.median, b.percentile(90), b.percentile(99)) == pytest.approx(
            (s["mean"], s["median"], s["p90"], s["p99"])), bench_name
    assert bm.request_goodput == pytest.approx(sm["goodput"]["requests_per_s"])
    assert bm.good_completed == 2
    assert bm.request_throughput == pytest.approx(sm["request_throughput"])
    assert bm.output_throughput == pytest.approx(sm["output_token_throughput"])
    assert sm["queue_ms"]["mean"] == pytest.approx(1e3 * (0.125 + 0.25 + 0.0 + 0.5) / 4)


def test_prometheus_observes_the_same_definitions():
    m = Metrics("m")
    for arrival, first_sched, times in REQUESTS:
        prev = None
        for t in times:
            m.observe_new_tokens(arrival, prev, t)
            prev = t
        m.observe_finished("stop", RequestMetrics(
            arrival, first_sched, times[0], times[-1], num_output_tokens=len(times),
            last_token_time=times[-1]))
    lat = _latencies()
    itls = [g for _, _, t in REQUESTS for g in inter_token_latencies(t)]

    def sample(name: str, suffix: str) -> float:
        v = m.registry.get_sample_value(f"iterserve:{name}_{suffix}",
                                        {"model_name": "m", "engine": "0"})
        assert v is not None
        return v

    for name, values in (("time_to_first_token_seconds", lat.ttft),
                         ("inter_token_latency_seconds", itls),
                         ("e2e_request_latency_seconds", lat.e2e),
                         ("request_queue_time_seconds", lat.queue),
                         ("request_time_per_output_token_seconds",
                          lat.tpot[~np.isnan(lat.tpot)]),
                         ("request_prefill_time_seconds", lat.ttft - lat.queue),
                         ("request_decode_time_seconds", lat.e2e - lat.ttft),
                         ("request_inference_time_seconds", lat.e2e - lat.queue)):
        assert sample(name, "count") == len(values), name
        assert sample(name, "sum") == pytest.approx(float(np.sum(values))), name


def _latencies() -> RequestLatencies:
    sim = _sim_result()
    return RequestLatencies.from_times(sim.arrival, sim.first_scheduled, sim.first_token,
                                       sim.finished, sim.output_len)


def _sim_result() -> SimResult:
    """The simulator's raw record of REQUESTS (what Simulator.run() fills in)."""
    col = lambda f: np.array([f(r) for r in REQUESTS], dtype=np.float64)  # noqa: E731
    empty = np.zeros(0)
    return SimResult(
        label="hand-made",
        arrival=col(lambda r: r[0]),
        first_scheduled=col(lambda r: r[1]),
        first_token=col(lambda r: r[2][0]),
        finished=col(lambda r: r[2][-1]),
        prompt_len=np.full(len(REQUESTS), 10, dtype=np.int64),
        output_len=np.array([len(r[2]) for r in REQUESTS], dtype=np.int64),
        num_preemptions=np.zeros(len(REQUESTS), dtype=np.int64),
        itl=np.array([g for _, _, t in REQUESTS for g in inter_token_latencies(t)]),
        step_time=empty, step_dt=empty, step_running=empty.astype(np.int64),
        step_waiting=empty.astype(np.int64), step_batch=empty.astype(np.int64),
        step_tokens=empty.astype(np.int64), step_kv_usage=empty,
    )
