"""`iterserve simulate` end to end on a small workload (no torch imported)."""

from __future__ import annotations

import json

from iterserve.entrypoints.cli import main


def test_simulate_compare_writes_json_and_plots(tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["simulate", "--num-requests", "60", "--request-rate", "10", "--prompt-len", "uniform:16:200",
               "--output-len", "lognormal:40:1:300", "--scheduler", "static,continuous",
               "--goodput", "ttft:500", "tpot:50", "--out", str(out), "--plain", "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "Stability check" in text and "continuous" in text and "static" in text
    doc = json.loads((out / "result.json").read_text())
    assert [r["label"] for r in doc["runs"]] == ["static", "continuous"]
    assert doc["runs"][1]["metrics"]["goodput"]["slos_ms"] == {"ttft": 500.0, "tpot": 50.0}
    assert (out / "timeline.png").stat().st_size > 0 and (out / "latency_cdf.png").stat().st_size > 0


def test_simulate_sweep_and_check_only(tmp_path, capsys):
    out = tmp_path / "sweep"
    rc = main(["simulate", "--num-requests", "40", "--prompt-len", "fixed:64", "--output-len", "fixed:16",
               "--sweep", "5,50", "--out", str(out), "--no-progress", "--no-plots"])
    assert rc == 0
    doc = json.loads((out / "sweep.json").read_text())
    assert [p["rate"] for p in doc["runs"]["continuous"]] == [5.0, 50.0]
    # --check-only exits non-zero when the workload is oversubscribed.
    assert main(["simulate", "--num-requests", "200", "--request-rate", "10000", "--check-only"]) == 1
    assert "WARNING: oversubscribed" in capsys.readouterr().out
    assert main(["simulate", "--num-requests", "200", "--request-rate", "0.5", "--check-only"]) == 0


def test_simulate_trace_with_policies(capsys):
    # A shipped trace, by name.
    rc = main(["simulate", "--trace", "splitwise_code", "--num-requests", "100", "--time-scale", "0.05",
               "--policy", "fcfs,sjf", "--reveal-output-len", "--plain", "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "fcfs" in text and "sjf" in text


def test_compare_with_a_bench_serve_result(tmp_path, capsys):
    records = [
        {"arrival_time": 0.1 * i, "send_time": 0.1 * i, "prompt_len": 100, "output_len": 11,
         "ttft": 0.05, "itls": [0.02] * 10, "e2el": 0.25, "success": True}
        for i in range(20)
    ]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"duration": 2.15, "records": records}))
    rc = main(["simulate", "--num-requests", "20", "--request-rate", "10", "--prompt-len", "fixed:100",
               "--output-len", "fixed:11", "--compare-with", str(path), "--plain", "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "measured" in text
    ttft_row = next(line for line in text.splitlines() if line.startswith("TTFT mean"))
    assert ttft_row.split()[-1] == "50.00"
