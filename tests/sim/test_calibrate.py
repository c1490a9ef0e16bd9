"""Calibration: the least-squares fit recovers known parameters; shapes come from the real scheduler."""

from __future__ import annotations

import itertools

import pytest

from iterserve.core.outputs import ModelRunnerOutput
from iterserve.sim.calibrate import (
    GridPoint,
    StepSample,
    collect_samples,
    fit_cost_model,
    synthetic_samples,
)
from iterserve.sim.cost_model import HARDWARE_PRESETS, MODEL_PRESETS, CostModel, roofline_cost_model


@pytest.mark.parametrize(
    "truth",
    [
        CostModel(t0=4e-3, prefill_token=3e-5, decode_seq=5e-5, context_token=2e-7, swap_block=1e-4),
        roofline_cost_model(MODEL_PRESETS["llama-2-7b"], HARDWARE_PRESETS["h100"]),
        CostModel(t0=2e-3, prefill_token=1e-4, decode_seq=3e-4, context_token=5e-8, swap_block=0.0),
    ],
)
def test_fit_recovers_known_parameters_within_5_percent(truth):
    samples = synthetic_samples(truth, n=300, noise=0.01, seed=1)
    fitted = fit_cost_model(samples)
    for name in ("t0", "prefill_token", "decode_seq", "context_token", "swap_block"):
        want, got = getattr(truth, name), getattr(fitted, name)
        assert got == pytest.approx(want, rel=0.05, abs=1e-12), name
    assert fitted.fit["rms_rel_error"] < 0.02
    assert fitted.fit["r2"] > 0.99


def test_fit_keeps_coefficients_non_negative_and_pins_fixed():
    # Timings that do not depend on context: an unconstrained fit could go negative.
    samples = [StepSample(p, d, c, 0, 1e-3 + 1e-5 * p) for p, d, c in
               [(0, 1, 100), (10, 2, 50), (100, 0, 100), (500, 4, 10), (50, 8, 900), (0, 16, 3)]]
    cm = fit_cost_model(samples, fixed={"swap_block": 2e-4})
    assert min(cm.params()) >= 0
    assert cm.swap_block == 2e-4
    assert cm.t0 == pytest.approx(1e-3, rel=0.01)
    assert cm.prefill_token == pytest.approx(1e-5, rel=0.01)
    with pytest.raises(ValueError):
        fit_cost_model(samples[:1])


class _FakeRunner:
    """One token per request whose prefill completes (what a model runner returns)."""

    def execute(self, so):
        sampled = {
            r.request_id: 5
            for r, n, c in zip(so.scheduled_requests, so.num_scheduled_tokens, so.num_computed_tokens)
            if c + n == r.num_tokens
        }
        return ModelRunnerOutput(sampled)


def test_collect_samples_drives_the_real_scheduler_over_the_grid():
    grid = [GridPoint(batch_size=4, context_len=100, chunk=64, decode_steps=3),
            GridPoint(batch_size=1, context_len=30, chunk=64, decode_steps=2)]
    samples = collect_samples(_FakeRunner(), grid, num_gpu_blocks=256, block_size=16)
    # Every prompt token is prefilled, in chunks within the budget.
    # (the first shape also runs once unrecorded, as warmup)
    assert sum(s.num_prefill_tokens for s in samples) == 4 * 100 + 30
    assert max(s.num_prefill_tokens + s.num_decode_seqs for s in samples) <= 64
    decodes = [s for s in samples if s.num_prefill_tokens == 0]
    assert decodes and max(s.num_decode_seqs for s in decodes) == 4
    assert all(s.seconds >= 0 for s in samples)


def test_one_token_steps_fitted_apart():
    """A runner with a one-token path (the CPU decoder): its steps follow their own
    line, far below the batched path's fixed cost. Fitted apart, both regimes come
    back within 5%; fitted together, the batched fixed cost is dragged down."""
    import numpy as np

    from iterserve.sim.calibrate import StepSample, fit_cost_model, predict, synthetic_samples

    truth = CostModel(t0=8e-3, prefill_token=2e-5, decode_seq=4e-4, context_token=5e-8)
    rng = np.random.default_rng(1)
    lone = []
    for _ in range(80):
        ctx = int(rng.integers(1, 4096))
        t = (3e-3 + 2e-8 * ctx) * (1 + 0.01 * rng.standard_normal())
        lone.append(StepSample(0, 1, ctx, 0, t))
    batched = [s for s in synthetic_samples(truth, n=300, seed=2) if not s.is_lone]
    from iterserve.model.step_layout import VARLEN, RunnerLayout

    cm = fit_cost_model(batched + lone, layout=RunnerLayout(attention=VARLEN, lone_token_path=True))
    assert cm.t0 == pytest.approx(truth.t0, rel=0.05)
    assert cm.decode_seq == pytest.approx(truth.decode_seq, rel=0.05)
    assert cm.lone_t0 == pytest.approx(3e-3, rel=0.05)
    assert cm.lone_context_token == pytest.approx(2e-8, rel=0.05)
    assert cm.fit["num_lone_samples"] == 80
    assert predict(cm, lone[0]) == pytest.approx(cm.lone_time(lone[0].num_context_tokens))
    assert CostModel.from_dict(cm.to_dict()).lone_t0 == cm.lone_t0
    mixed = fit_cost_model(batched + lone)
    assert mixed.lone_t0 == 0.0 and mixed.t0 < 0.9 * truth.t0


def test_the_grid_fits_a_2048_token_context():
    """A model with a 2,048-token context: the default grid's long shapes (many prompts
    prefilled in many chunks, so long outputs) are clipped to fit the context, said in
    the notes, and every request of every shape fits (no request is refused)."""
    from iterserve.sim.calibrate_grid import (
        default_grid,
        fit_to_context,
        heldout_grid,
        max_tokens_of,
    )

    max_len = 2048
    max_ctx = max_len - 64  # what calibrate() gives the grid
    grid = default_grid(max_context=max_ctx, kv_tokens=8192 * 16)
    grid += heldout_grid(max_context=max_ctx, kv_tokens=8192 * 16)
    # Many long prompts prefilled in many chunks (an earlier grid's largest shape): their
    # outputs overflow the context, the crash this guards against.
    grid.append(GridPoint(64, max_ctx, 2048, 8, 0.75))
    overflowing = [p for p in grid if p.context_len + max_tokens_of(p) > max_len]
    assert overflowing
    for p in grid:
        q = fit_to_context(p, max_len)
        assert q is not None and q.context_len + max_tokens_of(q) <= max_len
        assert q.late_prompt + 2 <= max_len
        assert (q == p) == (p not in overflowing)
    assert fit_to_context(GridPoint(64, 2000, 64), 128) is None  # nothing of it fits


def test_calibrate_on_a_2048_token_context_runs_every_shape_or_says_why():
    """The held-out check's crash: calibrate over the full grid on a 2,048-token model
    finishes, its notes name the clipped shapes, and the fit comes back."""
    from iterserve.sim.calibrate import GridPoint, calibrate

    grid = [GridPoint(64, 1984, 2048, 8, 0.75), GridPoint(2, 64, 64, 2)]
    notes: list[str] = []
    cm = calibrate(_FakeRunner(), num_gpu_blocks=8192, block_size=16, grid=grid,
                   max_model_len=2048, vocab_size=1000, heldout=False, notes_out=notes)
    assert any(n.startswith("clipped shape (batch 64, context 1984") for n in notes), notes
    assert cm.fit["num_samples"] > 0 and cm.meta["grid_notes"] == notes


def test_a_shape_that_cannot_run_costs_only_that_shape():
    class FailsOnBigBatches(_FakeRunner):
        def execute(self, so):
            if len(so.scheduled_requests) > 4:
                raise RuntimeError("out of memory")
            return super().execute(so)

    grid = [GridPoint(2, 40, 64, 2), GridPoint(8, 40, 64, 2), GridPoint(1, 30, 64, 2)]
    notes: list[str] = []
    samples = collect_samples(FailsOnBigBatches(), grid, num_gpu_blocks=256, block_size=16,
                              notes=notes)
    assert notes == ["skipped shape (batch 8, context 40, chunk 64): RuntimeError: "
                     "out of memory"]
    # The failed shape's steps are gone; the others' are all there.
    assert sum(s.num_prefill_tokens for s in samples) == 2 * 40 + 30
    with pytest.raises(RuntimeError, match="no grid shape could be timed"):
        collect_samples(FailsOnBigBatches(), [GridPoint(8, 40, 64, 2)], num_gpu_blocks=256)


class _TableRecorder(_FakeRunner):
    """Records the block ids each request's KV went to."""

    def __init__(self):
        self.tables: dict[str, list[int]] = {}

    def execute(self, so):
        for r in so.scheduled_requests:
            self.tables[r.request_id] = list(r.block_ids)
        return super().execute(so)


@pytest.mark.parametrize("scatter", [True, False])
def test_calibration_reads_kv_from_scattered_blocks_as_a_served_pool_does(scatter):
    """A served pool hands out blocks in the order they were freed; calibration scatters
    its pools the same way (or keeps a fresh pool's order when asked), and says which."""
    from iterserve.sim.calibrate import calibrate

    runner = _TableRecorder()
    grid = [GridPoint(batch_size=2, context_len=200, chunk=512, decode_steps=2)]
    cm = calibrate(runner, num_gpu_blocks=256, block_size=16, grid=grid, max_model_len=1024,
                   vocab_size=1000, heldout=False, scatter_kv=scatter)
    assert cm.meta["kv_blocks"] == ("scattered" if scatter else "in order")
    runs = [all(b - a == 1 for a, b in itertools.pairwise(t)) for t in runner.tables.values()]
    assert runs and all(len(t) >= 13 for t in runner.tables.values())
    assert (not any(runs)) if scatter else all(runs)


def test_scattering_a_pool_keeps_its_blocks_and_invariants():
    import numpy as np

    from iterserve.core.block_pool import BlockPool
    from iterserve.sim.calibrate import scatter_free_blocks

    for reserve_null in (False, True):
        pool = BlockPool(64, reserve_null=reserve_null)
        before = sorted(pool.free_block_ids())
        scatter_free_blocks(pool, np.random.default_rng(3))
        pool.check_invariants()
        order = pool.free_block_ids()
        assert sorted(order) == before and order != before
        assert pool.allocate_ids(5) == order[:5]  # handed out in the scattered order
