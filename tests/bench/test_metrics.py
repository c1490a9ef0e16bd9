"""Metric definitions on hand-made records: TPOT, goodput, table, result files."""

from __future__ import annotations

import json

import pytest

from iterserve.bench.metrics import RequestRecord, calculate_metrics, format_table, parse_goodput
from iterserve.bench.results import build_result, load_result, records_of, save_result


def rec(ttft, itl, n, **kw):
    itls = [itl] * (n - 1)
    return RequestRecord(
        arrival_time=0.0, send_time=kw.pop("send_time", 0.0), prompt_len=10, output_len=n,
        expected_output_len=n, ttft=ttft, itls=itls, e2el=ttft + sum(itls), **kw,
    )


def test_tpot_excludes_first_token_and_single_token_requests():
    records = [rec(0.5, 0.02, 11), rec(0.1, 0.0, 1)]
    m = calculate_metrics(records, duration=2.0, percentiles=[50])
    assert records[0].tpot == pytest.approx(0.02)
    assert records[1].tpot is None
    assert m.stats["tpot"].mean == pytest.approx(20.0)  # only the 11-token request counts
    assert m.stats["itl"].mean == pytest.approx(20.0)
    assert m.stats["ttft"].mean == pytest.approx(300.0)
    assert m.total_output == 12 and m.total_input == 20
    assert m.output_throughput == pytest.approx(6.0)
    assert m.total_token_throughput == pytest.approx(16.0)


def test_goodput_counts_exactly_the_requests_meeting_every_slo():
    records = [
        rec(0.10, 0.010, 10),  # good
        rec(0.30, 0.010, 10),  # ttft too slow
        rec(0.10, 0.060, 10),  # tpot too slow
        rec(0.20, 0.050, 10),  # exactly on both limits: good (<=)
        rec(0.05, 0.0, 1),  # one token: tpot counts as 0 -> good
        RequestRecord(0.0, 0.0, 10, 0, success=False, error="x", error_code="429"),
    ]
    slos = parse_goodput(["ttft:200", "tpot:50"])
    m = calculate_metrics(records, duration=2.0, goodput_slos_ms=slos)
    assert m.good_completed == 3
    assert m.request_goodput == pytest.approx(1.5)
    assert m.completed == 5 and m.failed == 1 and m.num_rate_limited == 1
    e2el_only = calculate_metrics(records, 1.0, goodput_slos_ms={"e2el": 250.0})
    assert e2el_only.good_completed == 2  # e2el 0.19, 0.39, 0.64, 0.65, 0.05 s


@pytest.mark.parametrize("bad", ["ttft", "ttft:abc", "foo:10", "ttft:-1"])
def test_parse_goodput_rejects(bad):
    with pytest.raises(ValueError):
        parse_goodput([bad])


def test_table_layout_matches_vllm():
    records = [rec(0.1, 0.01, 5), rec(0.2, 0.01, 5)]
    m = calculate_metrics(records, 1.0, percentiles=[50, 99], goodput_slos_ms={"ttft": 150})
    table = format_table(m, max_concurrency=4, request_rate=2.0, goodput_slos_ms={"ttft": 150})
    lines = table.splitlines()
    assert lines[0] == "{:=^50}".format(" Serving Benchmark Result ")
    assert lines[-1] == "=" * 50
    assert lines[1] == "{:<40} {:<10}".format("Successful requests:", 2)
    assert "{:<40} {:<10.2f}".format("Request goodput (req/s):", 1.0) in lines
    assert "{:-^50}".format("Time to First Token") in lines
    assert "{:-^50}".format("Time per Output Token (excl. 1st token)") in lines
    assert "{:<40} {:<10.2f}".format("P99 TTFT (ms):", m.stats["ttft"].percentiles[1][1]) in lines
    assert not any("E2EL" in line for line in lines)  # not selected by default


def test_peaks():
    records = [rec(0.1, 0.1, 10, send_time=0.0), rec(0.1, 0.1, 10, send_time=0.5),
               rec(0.1, 0.1, 10, send_time=5.0)]
    m = calculate_metrics(records, 6.0)
    assert m.max_concurrent_requests == 2
    assert m.max_output_tokens_per_s >= 10


def test_result_json_roundtrip(tmp_path):
    records = [rec(0.1, 0.01, 5, priority=1, tenant="a"),
               RequestRecord(0.5, 0.5, 7, 0, success=False, error="boom", error_code="connection")]
    m = calculate_metrics(records, 1.0, percentiles=[50, 90, 99])
    result = build_result(records, m, {"source": "measured", "request_rate": "inf"})
    path = save_result(result, tmp_path / "r.json")
    loaded = load_result(path)
    for key in ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "p90_tpot_ms", "p50_itl_ms",
                "mean_e2el_ms", "request_throughput", "output_throughput",
                "total_token_throughput", "completed", "failed", "errors_by_code"):
        assert key in loaded
    assert loaded["errors_by_code"] == {"connection": 1}
    back = records_of(loaded)
    assert back == records
    assert loaded["ttfts"] == [0.1, 0.0]


def test_load_vllm_style_result(tmp_path):
    vllm = {"ttfts": [0.1, 0.2], "itls": [[0.01, 0.01], [0.02]], "latencies": [0.12, 0.22],
            "input_lens": [5, 6], "output_lens": [3, 2], "errors": ["", ""],
            "request_throughput": 1.0, "output_throughput": 5.0}
    path = tmp_path / "vllm.json"
    path.write_text(json.dumps(vllm))
    recs = records_of(load_result(path))
    assert [r.output_len for r in recs] == [3, 2] and recs[1].itls == [0.02]
    assert all(r.success for r in recs)


def test_simulator_runs_load_and_plot_beside_a_measured_run(tmp_path):
    from iterserve.bench.plot import plot_results
    from iterserve.bench.results import load_results

    recs = [rec(0.1 * (i + 1), 0.01, 5, send_time=0.1 * i) for i in range(5)]
    measured = save_result(
        build_result(recs, calculate_metrics(recs, 1.0), {"label": "measured"}),
        tmp_path / "m.json",
    )
    sim_doc = {"schema": "iterserve.sim.result/v1", "runs": [
        {"label": f"sim-{p}", "config": {}, "metrics": {"request_throughput": 4.0,
                                                         "output_token_throughput": 20.0},
         "records": [dict(r.to_json(), itls=[]) for r in recs]}
        for p in ("fcfs", "sjf")
    ]}
    sim = tmp_path / "sim.json"
    sim.write_text(json.dumps(sim_doc))
    runs = load_results(sim)
    assert [r["label"] for r in runs] == ["sim-fcfs", "sim-sjf"]
    assert records_of(runs[0])[0].ttft == pytest.approx(0.1)
    png = plot_results([str(measured), str(sim)], tmp_path / "p.png")
    assert png.stat().st_size > 10_000
    with pytest.raises(ValueError, match="labels"):
        plot_results([str(measured), str(sim)], tmp_path / "q.png", labels=["a", "b"])
