"""``serve --request-log``: one JSON line per finished request, on the engine's clock,
agreeing with the response and with the Prometheus histograms' counts."""

from __future__ import annotations

import httpx

from iterserve.entrypoints.cli import build_parser
from iterserve.measure.request_log import RequestLog, read_request_log, summarize_records
from tests.server.helpers import MODEL


def test_request_log_flag_parses():
    args = build_parser().parse_args(["serve", "--request-log", "/tmp/x.jsonl"])
    assert args.request_log == "/tmp/x.jsonl"
    assert build_parser().parse_args(["serve"]).request_log is None


def test_each_finished_request_is_one_record(server, tmp_path):
    path = tmp_path / "requests.jsonl"
    server.engine.request_log = RequestLog(path)
    try:
        url = server.base_url + "/v1/completions"
        for n in (3, 5):
            r = httpx.post(url, json={"model": MODEL, "prompt": "hello there", "max_tokens": n,
                                      "ignore_eos": True}, timeout=60)
            assert r.status_code == 200, r.text
        r = httpx.post(url, json={"model": MODEL, "prompt": "two", "max_tokens": 2, "n": 2,
                                  "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        server.engine.request_log.close()
        server.engine.request_log = None
    recs = read_request_log(path)
    assert [r["num_output_tokens"] for r in recs] == [3, 5, 2, 2]  # n=2: one per sample
    for rec in recs:
        assert rec["finish_reason"] == "length"
        assert 0 <= rec["queue_time"] <= rec["ttft"] <= rec["e2e"]
        assert rec["arrival_time"] <= rec["first_token_time"] <= rec["finished_time"]
        assert rec["num_token_outputs"] >= 1 and rec["num_prompt_tokens"] > 0
    assert recs[1]["itl_mean"] > 0 and recs[1]["tpot"] > 0
    s = summarize_records(recs)
    assert s["num_requests"] == 4 and s["output_throughput"] > 0 and s["ttft_mean_ms"] > 0
