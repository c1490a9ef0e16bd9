"""The cost model's long-context terms: idle decode threads and the cost per token past
context knots; their features, fit, persistence, use in the simulator, and the grid that
fits them."""

from __future__ import annotations

import json
from itertools import permutations

import numpy as np
import pytest

from iterserve.core.outputs import SchedulerOutput
from iterserve.core.request import Request
from iterserve.core.sampling_params import SamplingParams
from iterserve.model.step_layout import PAGED, RunnerLayout
from iterserve.sim.calibrate import calibrate, default_grid, fit_to_context, heldout_grid
from iterserve.sim.calibrate_grid import max_tokens_of
from iterserve.sim.cost_model import FORMAT_VERSION, CostModel
from iterserve.sim.executor import SimulatedExecutor
from iterserve.sim.fit import fit_cost_model, predict, sample_of
from iterserve.sim.long_context import (
    chunk_excess_pairs,
    context_knots,
    decode_idle_tokens,
    long_context_features,
    step_rows,
)
from iterserve.sim.stability import stability_check
from iterserve.sim.workload import RequestSpec, Workload

PAGED_2 = RunnerLayout(block_size=16, attention=PAGED, decode_threads=2)
KNOTS = (512, 1024)


def _step(decode_ctx: list[int], prefills: list[tuple[int, int]]) -> SchedulerOutput:
    """Decodes with ``c`` computed tokens each, prefill chunks of (n new, c computed)."""
    reqs, nums, comps = [], [], []
    for i, c in enumerate(decode_ctx):
        r = Request(f"d{i}", [1], SamplingParams(), 0.0)
        r.all_token_ids.extend([7] * c)
        reqs.append(r), nums.append(1), comps.append(c)
    for i, (n, c) in enumerate(prefills):
        reqs.append(Request(f"p{i}", list(range(1, c + n + 2)), SamplingParams(), 0.0))
        nums.append(n), comps.append(c)
    return SchedulerOutput(1, reqs, nums, comps, sum(nums),
                           num_prefill_tokens=sum(n for n, _ in prefills),
                           num_decode_tokens=len(decode_ctx),
                           num_context_tokens=sum(c + 1 for c in decode_ctx)
                           + sum(n + c for n, c in prefills))


def _makespan(contexts: list[int], threads: int) -> int:
    """The busiest thread's tokens when rows, longest first, go to the next free thread."""
    loads = [0] * threads
    for c in sorted(contexts, reverse=True):
        loads[loads.index(min(loads))] += c
    return max(loads)


def test_idle_threads_follow_the_kernels_schedule():
    assert decode_idle_tokens([2000, 2000, 2000], 2) == 2 * 4000 - 6000
    assert decode_idle_tokens([2000, 100], 2) == 1900
    assert decode_idle_tokens([500] * 4, 2) == 0
    assert decode_idle_tokens([2000], 2) == 0  # one row: split across the team
    assert decode_idle_tokens([2000, 3, 5], 1) == 0
    rng = np.random.default_rng(0)
    for _ in range(50):
        ctx = [int(x) for x in rng.integers(1, 3000, int(rng.integers(2, 12)))]
        for threads in (2, 3, 4):
            want = threads * _makespan(ctx, threads) - sum(ctx) if len(ctx) >= threads else 0
            assert decode_idle_tokens(ctx, threads) == want


@pytest.mark.parametrize("n,c,k", [(1, 600, 512), (1, 100, 512), (64, 480, 512), (300, 0, 512),
                                   (2048, 0, 1024), (17, 2000, 1024), (5, 507, 512)])
def test_prefill_pairs_past_a_knot_count_each_querys_keys(n, c, k):
    assert chunk_excess_pairs(n, c, k) == sum(max(0, c + i + 1 - k) for i in range(n))


def test_knots_span_the_context():
    assert context_knots(2048) == (512, 1024)
    assert context_knots(4096) == (512, 1024, 2048)
    assert context_knots(1000) == ()
    assert len(context_knots(32768)) == 6


def _truth(so: SchedulerOutput) -> float:
    """A fake runner's step time with a superlinear long-context part, computed from the
    rows themselves: every decode row's tokens cost more past 512 and more again past
    1,024; the 2 threads idle behind the longest rows; prefill pairs past 1,024 cost 3x."""
    dec, chunks = step_rows(so.num_scheduled_tokens, so.num_computed_tokens)
    t = 2e-3 + 2e-5 * so.num_prefill_tokens + 1e-4 * so.num_decode_tokens
    t += 4e-8 * so.num_context_tokens
    t += sum(3e-8 * max(0, c - 512) + 6e-8 * max(0, c - 1024) for c in dec)
    if len(dec) >= 2:
        t += 2e-8 * (2 * _makespan(list(dec), 2) - sum(dec))
    for n, c in chunks:
        t += sum(1e-9 * (c + i + 1) + 2e-9 * max(0, c + i + 1 - 1024) for i in range(n))
    return t


def _random_steps(rng: np.random.Generator, n: int, max_ctx: int = 2000) -> list[SchedulerOutput]:
    steps = []
    for _ in range(n):
        kind = rng.integers(0, 3)
        # Some short batches, some long, most mixing both; fresh and deep prefill chunks.
        hi = max_ctx if rng.random() < 0.7 else 512
        dec = [] if kind == 1 else [int(x) for x in rng.integers(16, hi, int(rng.integers(1, 13)))]
        pre = [] if kind == 0 else [
            (int(rng.integers(16, 1024)), 0 if rng.random() < 0.3 else int(rng.integers(1, max_ctx - 1024)))
            for _ in range(int(rng.integers(1, 3)))]
        steps.append(_step(dec, pre))
    return steps


def test_fit_recovers_the_long_context_coefficients():
    rng = np.random.default_rng(3)
    steps = _random_steps(rng, 400)
    samples = [sample_of(so, _truth(so) * (1 + 0.001 * rng.standard_normal()), PAGED_2)
               for so in steps]
    cm = fit_cost_model(samples, layout=PAGED_2, context_knots=KNOTS)
    assert cm.context_knots == KNOTS and cm.decode_threads == 2
    for got, want in [(cm.t0, 2e-3), (cm.prefill_token, 2e-5), (cm.decode_seq, 1e-4),
                      (cm.context_token, 4e-8), (cm.decode_excess[0], 3e-8),
                      (cm.decode_excess[1], 6e-8), (cm.decode_imbalance_token, 2e-8),
                      (cm.prefill_attn, 1e-9), (cm.prefill_attn_masked, 1e-9),
                      (cm.prefill_excess[1], 2e-9)]:
        assert got == pytest.approx(want, rel=0.08)
    assert cm.prefill_excess[0] < 1e-10
    # The simulator prices steps it never saw as the fake runner runs them.
    for so in _random_steps(np.random.default_rng(4), 50):
        assert cm.step_time(so) == pytest.approx(_truth(so), rel=0.02)


def test_a_curved_cost_is_followed_where_one_price_per_token_is_not():
    """A fake runner whose cost per KV token grows smoothly with each row's context
    (1 + ctx / 1000): the linear model fitted over the whole context misprices a batch
    of long rows; the knots follow the curve."""
    def curved(so: SchedulerOutput) -> float:
        dec, _ = step_rows(so.num_scheduled_tokens, so.num_computed_tokens)
        return 1e-3 + 1e-4 * len(dec) + sum(1e-7 * c * (1 + c / 1000) for c in dec)

    rng = np.random.default_rng(5)
    train = [_step([int(x) for x in rng.integers(16, 2000, int(rng.integers(1, 17)))], [])
             for _ in range(300)]
    samples = [sample_of(so, curved(so), PAGED_2) for so in train]
    linear = fit_cost_model(samples, layout=PAGED_2)
    knotted = fit_cost_model(samples, layout=PAGED_2, context_knots=KNOTS)
    long_batch = _step([1900, 1850, 1800, 1950], [])
    lin_err = linear.step_time(long_batch) / curved(long_batch) - 1
    knot_err = knotted.step_time(long_batch) / curved(long_batch) - 1
    assert lin_err < -0.04 and abs(knot_err) < 0.02


def test_simulator_and_step_time_price_the_long_terms():
    cm = CostModel(t0=1e-3, prefill_token=1e-5, decode_seq=1e-4, context_token=1e-8,
                   context_knots=KNOTS, decode_excess=(1e-8, 2e-8), prefill_excess=(0.0, 1e-9),
                   decode_threads=2, decode_imbalance_token=5e-9)
    so = _step([1500, 1400, 300], [(200, 1100)])
    dec, chunks = step_rows(so.num_scheduled_tokens, so.num_computed_tokens)
    idle, d512, d1024, _, p1024 = long_context_features(dec, chunks, KNOTS, 2)
    assert (d512, d1024) == (989 + 889, 477 + 377)
    base = 1e-3 + 200 * 1e-5 + 3 * 1e-4 + so.num_context_tokens * 1e-8
    want = base + 5e-9 * idle + 1e-8 * d512 + 2e-8 * d1024 + 1e-9 * p1024
    assert cm.step_time(so) == pytest.approx(want)
    ex = SimulatedExecutor(cm)
    ex.execute(so)
    assert ex.last_step_time == pytest.approx(want)
    assert predict(cm, sample_of(so, 1.0, PAGED_2)) == pytest.approx(want)
    plain = CostModel(t0=1e-3, prefill_token=1e-5, decode_seq=1e-4, context_token=1e-8)
    assert not plain.has_long_context and plain.step_time(so) == pytest.approx(base)


def test_profiles_round_trip_and_old_ones_load(tmp_path):
    cm = CostModel(t0=1e-3, prefill_token=1e-5, decode_seq=1e-4, context_token=1e-8,
                   context_knots=KNOTS, decode_excess=(1e-8, 2e-8), prefill_excess=(0.0, 1e-9),
                   decode_threads=2, decode_imbalance_token=5e-9)
    path = tmp_path / "p.json"
    cm.save(path)
    d = json.loads(path.read_text())
    assert d["format_version"] == FORMAT_VERSION and d["context_knots"] == [512, 1024]
    back = CostModel.load(path)
    assert back == cm and back.has_long_context
    # A format-1 profile (no version, none of the new fields) loads with them off.
    old = {k: v for k, v in d.items() if k not in (
        "format_version", "context_knots", "decode_excess", "prefill_excess", "decode_threads",
        "decode_imbalance_token", "lone_excess")}
    path.write_text(json.dumps(old))
    legacy = CostModel.load(path)
    assert not legacy.has_long_context and legacy.context_knots == ()
    so = _step([1500, 1400, 300], [])
    assert legacy.step_time(so) == pytest.approx(1e-3 + 3e-4 + so.num_context_tokens * 1e-8)
    with pytest.raises(ValueError, match="format 3"):
        CostModel.from_dict({**d, "format_version": 3})
    with pytest.raises(ValueError, match="decode_excess"):
        CostModel(t0=0, prefill_token=0, decode_seq=0, context_token=0, context_knots=KNOTS,
                  decode_excess=(1e-8,))
    with pytest.raises(ValueError, match="context_knots"):
        CostModel(t0=0, prefill_token=0, decode_seq=0, context_token=0, context_knots=(1024, 512))


def test_capacity_counts_the_long_terms():
    cm = CostModel(t0=1e-3, prefill_token=1e-5, decode_seq=1e-4, context_token=1e-8)
    steep = CostModel(t0=1e-3, prefill_token=1e-5, decode_seq=1e-4, context_token=1e-8,
                      context_knots=KNOTS, decode_excess=(1e-8, 1e-8), prefill_excess=(0.0, 0.0))
    from iterserve.config import CacheConfig, SchedulerConfig

    wl = Workload([RequestSpec(0.1 * i, 1500, 40) for i in range(20)])
    sc, cc = SchedulerConfig(max_num_seqs=16), CacheConfig(block_size=16, num_gpu_blocks=4096)
    a, b = stability_check(wl, cm, sc, cc), stability_check(wl, steep, sc, cc)
    # 16 sequences decoding at 1,500 + 40 / 2 tokens: 1,008 past 512, 496 past 1,024.
    assert b.step_time_s - a.step_time_s == pytest.approx(16 * 1e-8 * (1008 + 496))
    assert b.capacity_requests_per_s < a.capacity_requests_per_s


def test_grid_holds_several_long_rows_and_deep_chunks_and_fits_a_2048_context():
    max_len = 2048
    grid = default_grid(max_context=max_len - 128, kv_tokens=8192 * 16)
    long_rows = [p for p in grid if 3 <= p.batch_size <= 8 and p.context_len >= 1536]
    assert {p.batch_size for p in long_rows} >= {3, 5, 6}
    assert any(p.late_prompt >= 1024 for p in grid)  # chunks at deep offsets beside decodes
    # Large batches stop where they carry nothing new (the prompts cost most of the time).
    assert all(p.batch_size * p.context_len <= 32768 for p in grid if p.batch_size >= 16)
    for p in grid + heldout_grid(max_context=max_len - 128, kv_tokens=8192 * 16):
        q = fit_to_context(p, max_len)
        assert q is not None and q.context_len + max_tokens_of(q) <= max_len
    assert len(default_grid(True, max_context=max_len - 128)) <= 12


def test_calibrate_fits_the_long_terms_on_a_2048_context():
    """The pipeline end to end on a runner that costs nothing: a 2,048-token context gets
    knots at 512 and 1,024, the paged runner's threads, every shape clipped or run."""
    from tests.sim.test_calibrate import _FakeRunner

    class PagedRunner(_FakeRunner):
        step_layout = PAGED_2

    grid = [p for p in default_grid(max_context=1920, kv_tokens=8192 * 16)
            if p.late_prompt or (p.batch_size in (3, 5) and p.context_len >= 1024)]
    notes: list[str] = []
    cm = calibrate(PagedRunner(), num_gpu_blocks=8192, block_size=16, grid=grid,
                   max_model_len=2048, vocab_size=1000, heldout=False, notes_out=notes)
    assert cm.context_knots == KNOTS and cm.decode_threads == 2
    assert cm.fit["num_samples"] > 20
    assert all(n.startswith("clipped") for n in notes)
    assert CostModel.from_dict(json.loads(json.dumps(cm.to_dict()))) == cm


def test_permuted_rows_give_the_same_features():
    so = _step([1500, 20, 700, 1900], [(64, 1200)])
    want = sample_of(so, 1.0, PAGED_2).long_features(KNOTS, 2)
    for order in permutations(range(5)):
        reqs = [so.scheduled_requests[i] for i in order]
        nums = [so.num_scheduled_tokens[i] for i in order]
        comps = [so.num_computed_tokens[i] for i in order]
        other = SchedulerOutput(1, reqs, nums, comps, sum(nums),
                                num_prefill_tokens=so.num_prefill_tokens,
                                num_decode_tokens=so.num_decode_tokens,
                                num_context_tokens=so.num_context_tokens)
        assert sample_of(other, 1.0, PAGED_2).long_features(KNOTS, 2) == want


def test_one_token_path_gets_its_own_cost_past_the_knots():
    """The runner's one-token path (the C++ decoder) is fitted apart, past the same knots."""
    lone_layout = RunnerLayout(block_size=16, attention=PAGED, lone_token_path=True,
                               decode_threads=2)
    rng = np.random.default_rng(7)

    def lone_truth(c: int) -> float:
        return 1e-3 + 2e-8 * c + 5e-8 * max(0, c - 1024)

    steps = [_step([int(c)], []) for c in rng.integers(16, 2000, 120)]
    steps += _random_steps(rng, 150)
    samples = [sample_of(so, (lone_truth(so.num_computed_tokens[0] + 1) if so.num_reqs == 1
                              and so.total_num_scheduled_tokens == 1 else _truth(so))
                         * (1 + 0.001 * rng.standard_normal()), lone_layout) for so in steps]
    cm = fit_cost_model(samples, layout=lone_layout, context_knots=KNOTS)
    assert cm.lone_t0 == pytest.approx(1e-3, rel=0.02)
    assert cm.lone_context_token == pytest.approx(2e-8, rel=0.1)
    assert cm.lone_excess[0] < 3e-9 and cm.lone_excess[1] == pytest.approx(5e-8, rel=0.1)
    one = _step([1800], [])
    assert cm.step_time(one) == pytest.approx(lone_truth(1801), rel=0.01)
    ex = SimulatedExecutor(cm)
    ex.execute(one)
    assert ex.last_step_time == pytest.approx(cm.step_time(one))
    assert CostModel.from_dict(cm.to_dict()).lone_excess == cm.lone_excess
