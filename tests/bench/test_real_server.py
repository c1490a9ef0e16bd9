"""bench serve against a real ``iterserve serve`` (the README's first command, the
built-in default model; ``tests/readme_server.py``): zero failures and a result file that
reloads."""

from __future__ import annotations

import pytest

from iterserve.bench.results import load_result, records_of
from iterserve.entrypoints.cli import main


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_short_run_against_iterserve(readme_server, tmp_path, endpoint):
    name = "run.json"
    argv = [
        "bench", "serve", "--base-url", readme_server, "--endpoint", endpoint,
        "--dataset-name", "random", "--num-prompts", "8", "--random-input-len", "24",
        "--random-output-len", "8", "--random-range-ratio", "0.5", "--tokenizer", "byte",
        "--ignore-eos", "--request-rate", "20", "--max-concurrency", "4",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(tmp_path), "--result-filename", name,
        "--disable-tqdm",
    ]
    assert main(argv) == 0
    result = load_result(tmp_path / name)
    assert result["completed"] == 8 and result["failed"] == 0, result["errors"]
    recs = records_of(result)
    # ignore_eos: every request generates exactly the tokens it asked for.
    assert all(r.output_len == r.expected_output_len for r in recs)
    assert all(r.ttft > 0 and r.e2el >= r.ttft for r in recs)
    assert result["total_output_tokens"] == sum(r.expected_output_len for r in recs)
    assert result["mean_ttft_ms"] > 0 and result["p99_e2el_ms"] > 0
