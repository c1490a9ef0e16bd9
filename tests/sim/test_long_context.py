"""Long contexts in calibration and validation: the grid reaches the model's context,
step errors split by context, and the shipped long-context trace."""

from __future__ import annotations

import pytest

from iterserve.measure.traces import read_trace_rows, shipped_traces
from iterserve.sim.calibrate import default_grid
from iterserve.sim.cost_model import CostModel
from iterserve.sim.fit import StepSample, context_bucket_errors, context_buckets


def test_grid_reaches_the_models_whole_context():
    grid = default_grid(max_context=8000, kv_tokens=1_000_000)
    longest = max(p.context_len for p in grid)
    assert longest == 8000
    # Long contexts only at small batches; every point fits the KV pool.
    assert all(p.batch_size <= 8 for p in grid if p.context_len > 2048)
    assert {4096, 8000} <= {p.context_len for p in grid}
    short = default_grid(max_context=1920)
    assert max(p.context_len for p in short) == 1920


def test_context_buckets_cover_the_context():
    assert context_buckets(2048) == [0, 256, 512, 1024, 2048]
    assert context_buckets(3000) == [0, 256, 512, 1024, 2048, 3000]


def test_context_bucket_errors_split_by_regime_and_context():
    cm = CostModel(t0=1e-3, prefill_token=1e-5, decode_seq=1e-4, context_token=1e-7)
    # decode steps of 4 sequences: short contexts priced right, long ones 2x the model.
    short = [StepSample(0, 4, 4 * 100, 0, cm.time_for(0, 4, 400), num_seqs=4)] * 3
    long_t = 2 * cm.time_for(0, 4, 4 * 1500)
    long = [StepSample(0, 4, 4 * 1500, 0, long_t, num_seqs=4)] * 2
    mixed = [StepSample(200, 3, 3 * 300 + 200, 0, cm.time_for(200, 3, 1100), num_seqs=4)]
    rows = context_bucket_errors(cm, short + long + mixed, context_buckets(2048))
    by = {(r["regime"], r["context_lo"]): r for r in rows}
    assert by[("decode", 0)]["num_samples"] == 3
    assert by[("decode", 0)]["total_rel_error"] == pytest.approx(0.0, abs=1e-12)
    assert by[("decode", 1024)]["num_samples"] == 2
    assert by[("decode", 1024)]["total_rel_error"] == pytest.approx(-0.5)
    assert by[("mixed", 256)]["num_samples"] == 1  # mean context 1100 / 4 = 275
    assert sum(r["num_samples"] for r in rows) == 6


def test_long_context_trace_is_shipped_and_long():
    assert "summarization_long" in shipped_traces()
    rows = read_trace_rows("summarization_long")
    prompts = [int(r["num_prefill_tokens"]) for r in rows]
    outputs = [int(r["num_decode_tokens"]) for r in rows]
    assert len(rows) == 2000
    assert min(prompts) >= 256 and max(prompts) <= 1984
    assert 1000 < sum(prompts) / len(prompts) < 1400
    assert 40 < sum(outputs) / len(outputs) < 70
