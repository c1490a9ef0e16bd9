"""docs/vllm-compat.md is what the code says today, and the generator reads our code."""

from __future__ import annotations

from pathlib import Path

from iterserve.entrypoints import vllm_compat as vc
from iterserve.entrypoints.protocol import CompletionRequest

DOC = Path(__file__).resolve().parents[2] / "docs" / "vllm-compat.md"


def test_committed_table_is_generated():
    assert DOC.read_text(encoding="utf-8") == vc.render(), (
        "docs/vllm-compat.md is out of date: run "
        "`python -m iterserve.entrypoints.vllm_compat --write docs/vllm-compat.md`")


def test_rows_come_from_our_code():
    data = vc.load_vllm_names()
    assert data["vllm_version"].startswith("0.33")
    flags = {r.vllm: r for r in vc.flag_rows(vc.serve_parser(), data["serve_flags"])}
    assert flags["`--max-num-seqs`"].status == vc.Y
    assert flags["`--headless`"].status == vc.NO
    routes = vc.our_routes()
    assert ("/v1/chat/completions", "POST") in routes and ("/metrics", "GET") in routes
    metrics = vc.our_metric_names()
    for name in ("request_prefill_time_seconds", "cache_config_info", "prompt_tokens_cached",
                 "request_num_preemptions", "admission_rejections"):
        assert name in metrics
    refused = vc.refused_fields()
    assert "use_beam_search" in refused
    rows = {r.vllm: r.status for r in vc.field_rows(["n", "use_beam_search", "nope"],
                                                    CompletionRequest, refused)}
    assert rows == {"`n`": vc.Y, "`use_beam_search`": vc.REFUSED, "`nope`": vc.NO}


def test_flag_statuses_follow_the_parser():
    import argparse

    class Refuse(argparse.Action):
        def __init__(self, *a, reason: str = "", **k):
            super().__init__(*a, **k)
            self.reason = reason

        def __call__(self, *a, **k):  # pragma: no cover - never parsed here
            raise AssertionError

    p = argparse.ArgumentParser()
    p.add_argument("model_tag", nargs="?")
    p.add_argument("--kv-cache-memory-bytes", "--kv-cache-memory")
    p.add_argument("--ours", "--theirs")
    p.add_argument("--quantization", "-q", action=Refuse, reason="not supported here")
    rows = vc.flag_rows(p, [
        {"flags": ["model_tag"]}, {"flags": ["--kv-cache-memory-bytes"]},
        {"flags": ["--theirs"]}, {"flags": ["--quantization", "-q"]},
        {"flags": ["--enable-x", "--no-enable-x"]},
    ])
    assert [(r.status, r.note) for r in rows] == [
        (vc.Y, ""), (vc.Y, ""), (vc.ALIAS, "iterserve's name: `--ours`"),
        (vc.REFUSED, "not supported here"), (vc.NO, ""),
    ]


def test_check_mode(tmp_path, capsys):
    stale = tmp_path / "compat.md"
    stale.write_text("old\n")
    assert vc.main(["--check", str(stale)]) == 1
    assert "out of date" in capsys.readouterr().err
    assert vc.main(["--write", str(stale)]) == 0
    assert vc.main(["--check", str(stale)]) == 0
