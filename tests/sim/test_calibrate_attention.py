"""The shape-dependent attention terms: decode padding (as the CPU runner lays decodes
out) and prefill query x key pairs; their fit, persistence and use in the simulator."""

from __future__ import annotations

import json

import numpy as np
import pytest

from iterserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from iterserve.core.request import Request
from iterserve.core.sampling_params import SamplingParams
from iterserve.model.step_layout import VARLEN, RunnerLayout
from iterserve.sim.calibrate import (
    GridPoint,
    StepSample,
    collect_samples,
    default_grid,
    fit_cost_model,
)
from iterserve.sim.cost_model import CostModel, attention_work
from iterserve.sim.executor import SimulatedExecutor

GROUPS_OF_16 = RunnerLayout(block_size=16, decode_group_size=16)


def _step(decode_ctx: list[int], prefills: list[tuple[int, int]]) -> SchedulerOutput:
    """Decodes with ``c`` computed tokens each, prefill chunks of (n new, c computed)."""
    reqs, nums, comps = [], [], []
    for i, c in enumerate(decode_ctx):
        r = Request(f"d{i}", [1], SamplingParams(), 0.0)
        r.all_token_ids.extend([7] * c)  # c tokens computed, the last output to decode
        reqs.append(r), nums.append(1), comps.append(c)
    for i, (n, c) in enumerate(prefills):
        reqs.append(Request(f"p{i}", list(range(1, c + n + 2)), SamplingParams(), 0.0))
        nums.append(n), comps.append(c)
    return SchedulerOutput(1, reqs, nums, comps, sum(nums),
                           num_prefill_tokens=sum(n for n, _ in prefills),
                           num_decode_tokens=len(decode_ctx),
                           num_context_tokens=sum(c + 1 for c in decode_ctx)
                           + sum(n + c for n, c in prefills))


def _runner_padding(so: SchedulerOutput, layout: RunnerLayout) -> int:
    """What the real runner's input building gathers for the step's decode rows beyond
    their contexts (the block tables and trims of the decode groups it builds)."""
    import torch

    from iterserve.model.inputs import InputBuilder
    from iterserve.model.model_config import ModelConfig

    bs = layout.block_size
    for r, n, c in zip(so.scheduled_requests, so.num_scheduled_tokens, so.num_computed_tokens):
        r.block_ids = list(range(-(-(c + n) // bs)))
    mc = ModelConfig("LlamaForCausalLM", 1, 8, 1, 1, 8, 16, 32, 4096)
    builder = InputBuilder(mc, bs, torch.device("cpu"), torch.float32)
    step = layout.plan(so.num_scheduled_tokens, so.num_computed_tokens)
    meta = builder.build(step, so.scheduled_requests, so.num_scheduled_tokens,
                         so.num_computed_tokens).meta
    assert meta.num_decode_tokens == step.num_decodes
    read = sum(g.context_len if g.context_len else g.block_table.numel() * bs
               for g in meta.decode_groups)
    return read - sum(so.num_computed_tokens[i] + 1 for i in step.decode_rows)


@pytest.mark.parametrize("decode_ctx", [
    [5], [5, 300], list(range(10, 700, 11)), [64] * 16, [1000, 3, 40, 17, 900, 33, 64, 65, 15, 16, 31],
    list(np.random.default_rng(0).integers(60, 1100, 61)),
])
def test_decode_padding_matches_the_runner_layout(decode_ctx):
    so = _step([int(c) for c in decode_ctx], [])
    pad, pairs = attention_work(so, GROUPS_OF_16)
    assert pairs == 0
    assert pad == _runner_padding(so, GROUPS_OF_16)
    groups_of_3 = RunnerLayout(block_size=16, decode_group_size=3)
    assert attention_work(so, groups_of_3)[0] == _runner_padding(so, groups_of_3)
    # The varlen path (one fused kernel): no groups, no padding.
    assert attention_work(so, RunnerLayout(block_size=16, attention=VARLEN)) == (0, 0)


def test_prefill_pairs_and_mixed_steps():
    so = _step([100, 200], [(64, 0), (32, 96)])
    pad, pairs = attention_work(so, GROUPS_OF_16)
    # causal half for a fresh prompt; with a prefix, the prefix plus its own causal half
    assert pairs == 64 * 65 // 2 + 32 * 96 + 32 * 33 // 2
    assert pad == (201 // 16 + 1) * 16 * 2 - 101 - 201 - 0  # padded to 208 tokens each
    assert pad == _runner_padding(so, GROUPS_OF_16)


def test_one_token_prompt_chunks_are_decode_rows():
    """A prompt chunk of one token runs as a decode row (one query over the gathered
    context), padded within its group: the cost model charges it so, not as prefill."""
    so = _step([40, 300], [(1, 200), (16, 0)])
    step = GROUPS_OF_16.plan(so.num_scheduled_tokens, so.num_computed_tokens)
    assert step.decode_rows == [0, 2, 1] and step.prefill_rows == [3]
    pad, pairs = attention_work(so, GROUPS_OF_16)
    assert pairs == 16 * 17 // 2
    assert pad == _runner_padding(so, GROUPS_OF_16) == (301 // 16 + 1) * 16 * 3 - 41 - 201 - 301


def test_step_time_and_simulator_include_the_attention_terms():
    cm = CostModel(t0=1e-3, prefill_token=1e-5, decode_seq=2e-5, context_token=1e-7,
                   decode_pad_token=3e-7, prefill_attn=1e-9, decode_group_size=16)
    so = _step(list(range(20, 660, 20)), [(128, 0), (64, 64)])
    pad, pairs = attention_work(so, GROUPS_OF_16)
    assert pad > 0 and pairs > 0
    want = cm.time_for(so.num_prefill_tokens, so.num_decode_tokens, so.num_context_tokens, 0,
                       pad, pairs)
    assert cm.step_time(so) == pytest.approx(want)
    ex = SimulatedExecutor(cm)
    ex.execute(so)
    assert ex.last_step_time == pytest.approx(want)
    # Uncalibrated terms cost nothing and skip the per-request walk.
    plain = CostModel(t0=1e-3, prefill_token=1e-5, decode_seq=2e-5, context_token=1e-7)
    assert plain.step_time(so) == pytest.approx(
        plain.time_for(so.num_prefill_tokens, so.num_decode_tokens, so.num_context_tokens))


def test_old_calibration_files_load_with_the_new_terms_zero(tmp_path):
    old = {"t0": 0.01, "prefill_token": 1e-4, "decode_seq": 1e-3, "context_token": 1e-6,
           "swap_block": 0.0, "name": "old", "fit": {"r2": 0.99}, "meta": {}}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    cm = CostModel.load(path)
    assert cm.decode_pad_token == 0 and cm.prefill_attn == 0 and cm.decode_group_size == 0
    new = CostModel(t0=0.01, prefill_token=1e-4, decode_seq=1e-3, context_token=1e-6,
                    decode_pad_token=2e-6, prefill_attn=3e-9, block_size=32, decode_group_size=8)
    new.save(tmp_path / "new.json")
    back = CostModel.load(tmp_path / "new.json")
    assert back.params() == new.params()
    assert (back.block_size, back.decode_group_size) == (32, 8)
    with pytest.raises(ValueError, match="decode_group_size"):
        CostModel(t0=0, prefill_token=0, decode_seq=0, context_token=0, decode_group_size=-1)


def test_fit_recovers_the_attention_terms():
    truth = CostModel(t0=12e-3, prefill_token=7e-4, decode_seq=1.4e-3, context_token=5e-6,
                      decode_pad_token=3e-6, prefill_attn=4e-7)
    rng = np.random.default_rng(3)
    samples = []
    for _ in range(300):
        p = int(rng.integers(0, 2049)) if rng.random() < 0.4 else 0
        d = int(rng.integers(0 if p else 1, 65))
        ctx = d * int(rng.integers(16, 1024)) + p + (int(rng.integers(0, 512)) if p else 0)
        pad = int(d * rng.integers(0, 400)) if d > 1 else 0
        pairs = int(p * rng.integers(1, 512)) if p else 0
        t = truth.time_for(p, d, ctx, 0, pad, pairs) * (1 + 0.01 * rng.standard_normal())
        samples.append(StepSample(p, d, ctx, 0, t, pad, pairs))
    fitted = fit_cost_model(samples, layout=GROUPS_OF_16)
    for name in ("t0", "prefill_token", "decode_seq", "context_token", "decode_pad_token",
                 "prefill_attn"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=0.1), name
    assert fitted.decode_group_size == 16


def test_default_grid_covers_the_workload_plane():
    grid = default_grid(max_context=1024, kv_tokens=4096 * 16)
    assert max(p.batch_size for p in grid) == 64
    assert max(p.chunk for p in grid) == 2048
    assert any(p.spread for p in grid) and any(not p.spread for p in grid)
    assert any(p.batch_size == 64 and p.context_len >= 512 for p in grid)
    for p in grid:
        # never preempts: prompts + outputs fit the KV cache
        need = p.batch_size * (p.context_len * (1 - p.spread / 2)
                               + p.batch_size * p.context_len / p.chunk + p.decode_steps + 2)
        assert need <= 4096 * 16
        assert p.batch_size * p.context_len / p.chunk <= 16 or p.chunk == 2048


class _GroupedFakeRunner:
    step_layout = RunnerLayout(block_size=16, decode_group_size=4)

    def execute(self, so):
        return ModelRunnerOutput({
            r.request_id: 5
            for r, n, c in zip(so.scheduled_requests, so.num_scheduled_tokens, so.num_computed_tokens)
            if c + n == r.num_tokens
        })


def test_spread_grid_points_produce_padded_decode_steps():
    grid = [GridPoint(batch_size=8, context_len=200, chunk=512, decode_steps=3, spread=0.75)]
    samples = collect_samples(_GroupedFakeRunner(), grid, num_gpu_blocks=512, block_size=16,
                              warmup=False)
    assert sum(s.num_prefill_tokens for s in samples) == sum(
        np.linspace(50, 200, 8).round().astype(int).tolist())
    decodes = [s for s in samples if s.num_prefill_tokens == 0 and s.num_decode_seqs == 8]
    assert decodes and all(s.num_decode_pad_tokens > 0 for s in decodes)
    assert any(s.num_prefill_attn_pairs > 0 for s in samples)


def test_padding_already_charged_by_a_baseline_is_not_charged_twice():
    ctx = [100, 200, 300, 400]
    so = _step(ctx, [])
    assert attention_work(so, GROUPS_OF_16)[0] > 0
    so.num_context_tokens = len(ctx) * (max(ctx) + 1)  # static batching: slots x longest
    assert attention_work(so, GROUPS_OF_16)[0] == 416 * 4 - 401 * 4  # only the rounding to blocks


def test_tied_padding_is_fitted_as_context():
    truth = CostModel(t0=10e-3, prefill_token=7e-4, decode_seq=1.4e-3, context_token=5e-6,
                      decode_pad_token=5e-6, prefill_attn=0.0)
    rng = np.random.default_rng(5)
    samples = []
    for _ in range(200):
        d = int(rng.integers(1, 65))
        ctx = d * int(rng.integers(16, 1024))
        pad = int(d * rng.integers(0, 300)) if d > 1 else 0
        t = truth.time_for(0, d, ctx, 0, pad) * (1 + 0.02 * rng.standard_normal())
        samples.append(StepSample(0, d, ctx, 0, t, pad, 0))
    fitted = fit_cost_model(samples, tie={"decode_pad_token": "context_token"})
    assert fitted.decode_pad_token == fitted.context_token
    assert fitted.context_token == pytest.approx(5e-6, rel=0.05)
    assert fitted.fit["mean_abs_rel_error"] < 0.03
