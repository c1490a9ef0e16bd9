"""bench serve against a stub server that streams with known delays."""

from __future__ import annotations

import socket

import pytest

from iterserve.bench.datasets import SampleRequest
from iterserve.bench.results import load_result, records_of
from iterserve.bench.serve import BenchConfig, benchmark
from iterserve.entrypoints.cli import main

# Two shared CPU cores and other test processes: allow generous scheduling jitter.
TOL_S = 0.03


def run(stub, requests, **cfg_kw):
    cfg = BenchConfig(base_url=stub.base_url, model="stub-model", disable_tqdm=True, **cfg_kw)
    return benchmark(requests, cfg, verbose=False)


def test_latencies_match_known_delays(stub):
    ttft, itl, n = 0.15, 0.03, 8
    reqs = [SampleRequest(f"ttft={ttft} itl={itl} hi", 3, n) for _ in range(6)]
    result = run(stub, reqs, metric_percentiles=(50, 99))
    assert result["completed"] == 6 and result["failed"] == 0
    for r in records_of(result):
        assert r.output_len == n  # from usage
        assert r.ttft == pytest.approx(ttft, abs=TOL_S)
        assert r.tpot == pytest.approx(itl, abs=0.01)
        assert len(r.itls) == n - 1
        assert all(g == pytest.approx(itl, abs=TOL_S) for g in r.itls)
        assert r.e2el == pytest.approx(ttft + (n - 1) * itl, abs=TOL_S)
        assert r.send_time >= 0
        assert r.prompt_len == len(reqs[0].prompt.encode())  # the server's usage wins
    assert result["median_ttft_ms"] == pytest.approx(ttft * 1000, abs=TOL_S * 1000)
    assert result["mean_tpot_ms"] == pytest.approx(itl * 1000, abs=10)
    assert result["median_itl_ms"] == pytest.approx(itl * 1000, abs=TOL_S * 1000)
    assert result["total_output_tokens"] == 6 * n
    # The body carried what OpenAI-compatible servers expect for a streamed benchmark.
    body = stub.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == n and body["model"] == "stub-model"
    assert "ignore_eos" not in body and "priority" not in body


def test_chat_endpoint_role_chunk_is_not_first_token(stub):
    reqs = [SampleRequest("ttft=0.12 itl=0.01 hello", 2, 4) for _ in range(2)]
    result = run(stub, reqs, endpoint="/v1/chat/completions")
    for r in records_of(result):
        assert r.success and r.output_len == 4
        assert r.ttft == pytest.approx(0.12, abs=TOL_S)
    assert stub.bodies[0]["messages"] == [{"role": "user", "content": reqs[0].prompt}]


def test_goodput_counts_exactly_requests_meeting_slos(stub):
    fast = [SampleRequest("ttft=0.02 itl=0.005", 1, 4) for _ in range(5)]
    slow = [SampleRequest("ttft=0.40 itl=0.005", 1, 4) for _ in range(3)]
    slow_tpot = [SampleRequest("ttft=0.02 itl=0.12", 1, 4) for _ in range(2)]
    result = run(stub, fast + slow + slow_tpot, goodput_slos_ms={"ttft": 200.0, "tpot": 60.0})
    assert result["completed"] == 10
    assert result["good_completed"] == 5
    assert result["request_goodput"] == pytest.approx(5 / result["duration"])


def test_max_concurrency_never_exceeded(stub):
    reqs = [SampleRequest("ttft=0.05 itl=0.005", 1, 4) for _ in range(24)]
    result = run(stub, reqs, max_concurrency=3)
    assert result["completed"] == 24
    assert stub.max_in_flight == 3
    assert result["max_concurrent_requests"] <= 3
    # Requests held back by the cap are sent later than they arrived.
    recs = records_of(result)
    assert max(r.send_time - r.arrival_time for r in recs) > 0.1


def test_request_rate_spreads_sends(stub):
    reqs = [SampleRequest("ttft=0.01 itl=0.001", 1, 2) for _ in range(20)]
    result = run(stub, reqs, request_rate=40.0, seed=1)
    recs = records_of(result)
    arrivals = [r.arrival_time for r in recs]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals) and arrivals[-1] > 0.1
    for r in recs:  # each request goes out at its arrival time (no cap here)
        assert r.send_time == pytest.approx(r.arrival_time, abs=0.05)


def test_failures_are_counted_not_raised(stub):
    reqs = (
        [SampleRequest("ttft=0.01 itl=0.001", 1, 3) for _ in range(3)]
        + [SampleRequest("mode=429", 1, 3) for _ in range(4)]
        + [SampleRequest("mode=500", 1, 3)]
        + [SampleRequest("mode=drop ttft=0.01 itl=0.01", 1, 6) for _ in range(2)]
        + [SampleRequest("mode=error_event ttft=0.01", 1, 6)]
    )
    result = run(stub, reqs)
    assert result["completed"] == 3
    assert result["failed"] == 8
    assert result["num_rate_limited"] == 4
    assert result["errors_by_code"] == {"429": 4, "500": 2, "connection": 2}
    recs = records_of(result)
    assert all(not r.success and r.error for r in recs[3:])
    assert all(r.output_len == 0 for r in recs[3:])


def test_server_gone_counts_connection_failures():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = BenchConfig(base_url=f"http://127.0.0.1:{port}", model="m", disable_tqdm=True)
    result = benchmark([SampleRequest("x", 1, 2) for _ in range(3)], cfg, verbose=False)
    assert result["completed"] == 0 and result["errors_by_code"] == {"connection": 3}


def test_no_usage_falls_back_to_chunk_count(stub):
    result = run(stub, [SampleRequest("mode=nousage ttft=0.01 itl=0.001", 1, 5)])
    (r,) = records_of(result)
    assert r.success and r.output_len == 5


def test_token_ids_priority_tenant_and_auth_are_sent(stub):
    req = SampleRequest([1, 2, 3], 3, 2, priority=7, tenant="acme")
    result = run(stub, [req], ignore_eos=True, api_key="sekret")
    assert result["completed"] == 1
    body, headers = stub.bodies[0], stub.headers[0]
    assert body["prompt"] == [1, 2, 3] and body["priority"] == 7 and body["user"] == "acme"
    assert body["ignore_eos"] is True
    assert headers["Authorization"] == "Bearer sekret" and headers["X-Tenant"] == "acme"
    assert "sekret" not in str(result)


def test_cli_end_to_end_saves_reloadable_json_and_plots(stub, tmp_path, capsys):
    argv = [
        "bench", "serve", "--base-url", stub.base_url, "--dataset-name", "random",
        "--num-prompts", "12", "--random-input-len", "16", "--random-output-len", "4",
        "--request-rate", "200", "--burstiness", "0.5", "--max-concurrency", "4",
        "--goodput", "ttft:500", "tpot:100", "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,90,99", "--tokenizer", "byte", "--priority", "0:1,1:1",
        "--tenants", "a,b", "--save-result", "--result-dir", str(tmp_path),
        "--label", "stubrun", "--metadata", "note=test", "--disable-tqdm",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "============ Serving Benchmark Result ============" in out
    assert "Request goodput (req/s):" in out and "P90 E2EL (ms):" in out
    (path,) = tmp_path.glob("stubrun-200qps-concurrency4-stub-model-*.json")
    result = load_result(path)
    assert result["completed"] == 12 and result["failed"] == 0
    assert result["model_id"] == "stub-model" and result["note"] == "test"
    assert result["p90_e2el_ms"] > 0 and result["good_completed"] == 12
    recs = records_of(result)
    assert len(recs) == 12 and {r.tenant for r in recs} == {"a", "b"}
    assert all(r.prompt_len == 16 for r in recs)
    assert stub.max_in_flight <= 4

    png = tmp_path / "plot.png"
    assert main(["bench", "plot", str(path), str(path), "-o", str(png), "--labels", "x,y"]) == 0
    assert png.stat().st_size > 10_000


def test_cli_rejects_bad_flags(capsys):
    assert main(["bench", "serve", "--goodput", "latency:5", "--num-prompts", "1"]) == 2
    assert "goodput" in capsys.readouterr().err
    assert main(["bench", "serve", "--endpoint", "/v1/chat/completions", "--send-token-ids",
                 "--num-prompts", "1"]) == 2
