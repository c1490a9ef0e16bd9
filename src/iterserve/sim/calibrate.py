"""Calibration: time a real executor over a grid of batch shapes and fit the cost model.

The shapes are produced by the production ``Scheduler`` (through ``EngineCore``),
so every timed step is a real ``SchedulerOutput``: B requests with C-token
prompts are prefilled in chunks of at most the token budget (prefill and mixed
samples), then decode together for a few steps (decode samples at context ~C). Every
other grid point spreads its prompt lengths, so decode batches of unequal
contexts (padded in the runner's decode groups) and prefill steps packing
several prompts are sampled too. Each ``execute`` call (or, with ``whole_step``,
each ``EngineCore.step``) is timed; a shape's median over repeats is fitted by
least squares on relative error (rows weighted by 1/t), non-negative coefficients
(``fit.py``). The runner's published step layout (``executor.step_layout``) says
how each step ran: its decode padding and prefill attention pairs become
features, and its one-token path, if any, is fitted apart. Each request's own context
prices the long-context terms (``long_context.py``: idle decode threads, tokens and pairs
past knots from 512 up to half the model's context).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import numpy as np

from iterserve.config import CacheConfig, SchedulerConfig
from iterserve.core.executor import Executor
from iterserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from iterserve.core.request import Request
from iterserve.core.sampling_params import SamplingParams
from iterserve.sim.calibrate_grid import (
    GridPoint,
    default_grid,
    fit_to_context,
    heldout_grid,
    max_tokens_of,
    shape_name,
    step_budget,
    vars_of,
)
from iterserve.sim.cost_model import CostModel
from iterserve.sim.fit import (
    ExpertShape,
    StepSample,
    fit_cost_model,
    predict,
    regime_errors,
    runner_layout,
    sample_of,
    synthetic_samples,
)
from iterserve.sim.long_context import context_knots as default_knots

# ---------------------------------------------------------------------------
# Timing a real executor
# ---------------------------------------------------------------------------


class TimingExecutor:
    """Wraps an executor and records one StepSample per execute()."""

    def __init__(self, inner: Executor, sync: Callable[[], None] | None = None,
                 block_size: int = 16) -> None:
        self.inner = inner
        # The inner runner's KV cache groups: the engine builds its scheduler with them.
        self.kv_cache_groups = getattr(inner, "kv_cache_groups", None)
        self.layout = runner_layout(inner, block_size)
        self.sync = sync  # e.g. torch.cuda.synchronize, so the timer sees the whole step
        self.samples: list[StepSample] = []
        self.record = True
        self.heldout = False  # mark the samples recorded as held out

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        so = scheduler_output
        if self.sync:
            self.sync()
        t = time.perf_counter()
        out = self.inner.execute(so)
        if self.sync:
            self.sync()
        dt = time.perf_counter() - t
        if self.record:
            self.samples.append(replace(sample_of(so, dt, self.layout), heldout=self.heldout))
        return out


def collect_samples(
    executor: Executor,
    grid: Iterable[GridPoint],
    *,
    num_gpu_blocks: int,
    block_size: int = 16,
    max_model_len: int = 4096,
    vocab_size: int = 32000,
    repeats: int = 1,
    warmup: bool = True,
    sync: Callable[[], None] | None = None,
    seed: int = 0,
    progress: bool = False,
    whole_step: bool = False,
    tokenizer: object = None,
    heldout: Iterable[GridPoint] = (),
    notes: list[str] | None = None,
    scatter_kv: bool = True,
) -> list[StepSample]:
    """Drive ``executor`` through the real EngineCore over ``grid``; return timed steps.

    A shape whose requests would not fit ``max_model_len`` is clipped to fit (or
    skipped when nothing of it fits), and a shape that fails to run is skipped, its
    steps dropped: each is said in ``notes``. Only when no shape runs at all is it an
    error.

    ``heldout`` points run interleaved with ``grid``'s (so a machine that slows down
    midway slows both alike); their steps come back marked ``heldout``.

    ``whole_step`` times ``EngineCore.step()`` (schedule + execute + update) and the
    output processor's detokenization with ``tokenizer``: the time a served step
    takes, which is what a simulation of the engine must reproduce. Otherwise only
    ``executor.execute``.

    ``scatter_kv``: each shape's KV blocks are handed out in a random order
    (``scatter_free_blocks``), as a server's pool does once requests have come and gone;
    otherwise in order, as a fresh pool does.
    """
    timer = TimingExecutor(executor, sync, block_size)
    samples = timer.samples
    notes = notes if notes is not None else []
    rng = np.random.default_rng(seed)
    main, held = list(grid), list(heldout)
    # Held-out points spread evenly among the others: (point, is held out).
    order = [(p, False) for p in main]
    for i, p in enumerate(held):
        order.insert(min(len(order), (i + 1) * len(order) // (len(held) + 1) + i), (p, True))
    # Steps of one or two sequences are bound by memory bandwidth, which moves within
    # minutes on shared machines: three times the repeats, and the median counts.
    points = [(p, h) for p, h in order
              for _ in range(repeats * (3 if p.batch_size <= 2 and not p.late_prompt else 1))]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(points), desc="calibrate", unit="shape")
    uid = 0
    warmed = not warmup
    for p, is_held in points:
        fitted = fit_to_context(p, max_model_len)
        if fitted is None:
            _note(notes, f"skipped {shape_name(p)}: its requests do not fit the "
                  f"{max_model_len}-token context")
        else:
            if fitted != p:
                _note(notes, f"clipped {shape_name(p)} to {shape_name(fitted)} to fit the "
                      f"{max_model_len}-token context")
            first = len(samples)
            try:
                uid = _time_shape(fitted, is_held, timer, samples, rng, uid,
                                  warm=not warmed, whole_step=whole_step, sync=sync,
                                  tokenizer=tokenizer, vocab_size=vocab_size,
                                  num_gpu_blocks=num_gpu_blocks, block_size=block_size,
                                  max_model_len=max_model_len, scatter_kv=scatter_kv)
                warmed = True
            except Exception as e:  # one shape that cannot run costs only that shape
                del samples[first:]
                why = str(e) if isinstance(e, _StepFailed) else f"{type(e).__name__}: {e}"
                _note(notes, f"skipped {shape_name(fitted)}: {why}")
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    if not samples and points:
        raise RuntimeError("no grid shape could be timed:\n  " + "\n  ".join(notes))
    return _median_per_shape(samples)


def _time_shape(p: GridPoint, is_held: bool, timer: TimingExecutor, samples: list[StepSample],
                rng: np.random.Generator, uid: int, *, warm: bool, whole_step: bool,
                sync: Callable[[], None] | None, tokenizer: object, vocab_size: int,
                num_gpu_blocks: int, block_size: int, max_model_len: int,
                scatter_kv: bool = True) -> int:
    """Run one grid shape through a fresh EngineCore, recording its timed steps; returns
    the next request number. ``warm``: run it once unrecorded first."""
    from iterserve.engine.core import EngineCore
    from iterserve.engine.output_processor import OutputProcessor

    perf = time.perf_counter
    timer.heldout = is_held
    late = p.late_prompt
    sc = SchedulerConfig(
        max_num_seqs=p.batch_size + (1 if late else 0),
        max_num_batched_tokens=step_budget(p),
        max_model_len=max_model_len,
    )
    # Prefix caching off: every prompt must really be computed.
    cc = CacheConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks,
                     enable_prefix_caching=False)
    engine = EngineCore(sc, cc, timer)
    if scatter_kv:
        scatter_free_blocks(engine.scheduler.kv.pool, rng)
    processor = OutputProcessor(tokenizer) if tokenizer is not None else None
    params = SamplingParams(max_tokens=max_tokens_of(p), ignore_eos=True, temperature=0.0)
    # The very first shape runs twice, unrecorded then recorded: first steps pay
    # one-off costs (allocations, kernel selection) a serving engine pays once.
    for record in ([False, True] if warm else [True]):
        timer.record = record and not whole_step
        lens = np.linspace(p.context_len * (1 - p.spread), p.context_len, p.batch_size)
        batch: list[Request] = []
        for length in rng.permutation(np.maximum(lens.round().astype(int), 1)).tolist():
            batch += _add_prompt(engine, processor, f"cal{uid}", rng, length, params,
                                 vocab_size)
            uid += 1
        pending_late = late
        while engine.has_unfinished_requests():
            if pending_late and all(r.num_output_tokens for r in batch):
                # The batch decodes: the long prompt arrives.
                late_params = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0)
                batch += _add_prompt(engine, processor, f"cal{uid}", rng, pending_late,
                                     late_params, vocab_size)
                uid += 1
                pending_late = 0
            if not whole_step:
                outs = engine.step()
                _check_step(engine, outs)
                if processor is not None:
                    processor.process_outputs(outs, 0.0)
                continue
            if sync:
                sync()
            t = perf()
            outs = engine.step()
            if processor is not None:
                processor.process_outputs(outs, 0.0)
            if sync:
                sync()
            dt = perf() - t
            _check_step(engine, outs)
            so = engine.last_scheduler_output
            if record and so is not None and so.scheduled_requests:
                samples.append(replace(sample_of(so, dt, timer.layout), heldout=is_held))
    return uid


def scatter_free_blocks(pool: Any, rng: np.random.Generator) -> None:
    """Put ``pool``'s free blocks (``core.block_pool.BlockPool``, none cached) in a random
    order. A fresh pool hands out blocks in order, so a request's KV lies in one run of
    memory; a server's pool, once requests have come and gone, hands out blocks in the
    order they were freed, scattered over the cache. On a CPU the scattered reads cost
    more (measured on a 2-core VM, 56M fp32, decode steps at 512-1,800 tokens of
    context: +2% to +27%, about +8% on average), and that is what a served step pays."""
    ids = pool.allocate_ids(pool.num_free_blocks)
    # free_ids walks its list from the end, each block to the queue's front: the queue
    # then holds the blocks in the permutation's order.
    pool.free_ids([int(i) for i in rng.permutation(ids)])


def _check_step(engine: Any, outs: Any) -> None:
    """A failed step (EngineCore finished its requests with ``error``) fails the shape."""
    if engine.num_failed_steps:
        raise _StepFailed(next((str(o.stop_reason) for o in outs if o.stop_reason),
                               "a step failed"))


class _StepFailed(RuntimeError):
    """A step of the shape failed; its message is already the error's name and text."""


def _note(notes: list[str], text: str) -> None:
    if text not in notes:  # repeats of a shape say it once
        notes.append(text)


def _add_prompt(engine: Any, processor: Any, request_id: str, rng: np.random.Generator,
                length: int, params: SamplingParams, vocab_size: int) -> list[Request]:
    """Add a random prompt of ``length`` tokens (through ``processor`` if any)."""
    ids = rng.integers(10, vocab_size - 10, size=length).tolist()
    if processor is None:
        reqs = [Request(request_id, ids, params, 0.0)]
    else:
        reqs = processor.add_request(request_id, [ids], params, 0.0)
    for r in reqs:
        engine.add_request(r)
    return reqs


def _median_per_shape(samples: list[StepSample]) -> list[StepSample]:
    """One sample per distinct step shape, its median time over repeats.

    The simulator must predict the wall time of ordinary steps, so the typical
    (median) time is the target; the minimum of a few repeats sits a few percent
    below it (4.5% at 2 repeats on a 2-core CPU). Steps hit hard by interference
    are still outvoted here, and dropped by the robust refit if they stand alone.
    """
    groups: dict[tuple[int, ...], list[StepSample]] = {}
    for s in samples:
        groups.setdefault((*s.shape, s.heldout), []).append(s)
    out = []
    for group in groups.values():
        group.sort(key=lambda s: s.seconds)
        k = len(group)
        mid = group[k // 2]
        if k % 2 == 0:
            mid = replace(mid, seconds=(group[k // 2 - 1].seconds + mid.seconds) / 2)
        out.append(mid)
    return out


def calibrate(
    executor: Executor,
    *,
    num_gpu_blocks: int,
    block_size: int = 16,
    grid: Iterable[GridPoint] | None = None,
    quick: bool = False,
    max_model_len: int = 4096,
    vocab_size: int = 32000,
    repeats: int = 1,
    sync: Callable[[], None] | None = None,
    name: str = "calibrated",
    meta: dict | None = None,
    swap_block: float | None = None,
    progress: bool = False,
    whole_step: bool = False,
    tokenizer: object = None,
    samples_out: list[StepSample] | None = None,
    heldout: Iterable[GridPoint] | bool = True,
    heldout_out: list[StepSample] | None = None,
    notes_out: list[str] | None = None,
    experts: ExpertShape | None = None,
    weights: dict[str, Any] | None = None,
    context_knots: Iterable[int] | None = None,
    scatter_kv: bool = True,
) -> CostModel:
    """Time ``executor`` over the grid and fit; ``swap_block`` pins the swap cost
    (the grid does no swaps, so it cannot be fitted from these samples).
    ``samples_out``, if given, receives the timed step shapes that were fitted.

    ``heldout`` (True: ``heldout_grid``; or points; False: none) is timed too but
    not fitted: the fit report (``cm.fit``) gives the error per regime on the
    fitted steps (``"regimes"``) and on these (``"heldout"``), which
    ``heldout_out`` receives. ``notes_out`` receives the shapes clipped to fit the
    context or skipped (also in the profile's ``grid_notes``).

    ``experts`` (a MoE model) fits ``expert_read`` (``fit.ExpertShape``); ``weights``
    records what the runner's weights are (``quantization``, ``bytes_per_weight``,
    ``weight_bytes``: the cost model's fields of those names). With both the expert
    bytes and the dense bytes known, the fitted seconds per expert byte prices the
    dense weights' read too: ``meta["t0_weight_read_s"]``, the part of ``t0`` that a
    format with fewer bytes per weight shrinks.

    ``context_knots`` (default: ``long_context.context_knots`` of the context the grid
    reaches) are where the long-context terms' cost per token may rise. ``scatter_kv``:
    see ``collect_samples`` (recorded in the profile's meta as ``kv_blocks``)."""
    # A grid prompt leaves room for its outputs (prefill + decode steps) in the context;
    # the grid caps each point's batch x context to the KV pool itself.
    # Room beside the prompt for its outputs: one per prefill step (at most 64 on the
    # grid) plus the decode steps and a late prompt's steps (``fit_to_context`` clips
    # any point that still does not fit).
    max_ctx = max(16, min(max_model_len - 128, num_gpu_blocks * block_size // 2))
    kv_tokens = num_gpu_blocks * block_size
    notes: list[str] = []
    pts = list(grid) if grid is not None else default_grid(
        quick, max_context=max_ctx, kv_tokens=kv_tokens)
    held_pts = (heldout_grid(quick, max_context=max_ctx, kv_tokens=kv_tokens)
                if heldout is True else list(heldout or []))
    timed = collect_samples(
        executor, pts, num_gpu_blocks=num_gpu_blocks, block_size=block_size,
        max_model_len=max_model_len, vocab_size=vocab_size, repeats=repeats, sync=sync,
        progress=progress, whole_step=whole_step, tokenizer=tokenizer, heldout=held_pts,
        notes=notes, scatter_kv=scatter_kv,
    )
    if notes_out is not None:
        notes_out.extend(notes)
    samples = [s for s in timed if not s.heldout]
    held = [s for s in timed if s.heldout]
    if samples_out is not None:
        samples_out.extend(samples)
    if heldout_out is not None:
        heldout_out.extend(held)
    fixed = {"swap_block": swap_block if swap_block is not None else 0.0}
    info = {"source": "calibration", "timed": "engine step" if whole_step else "executor",
            "kv_blocks": "scattered" if scatter_kv else "in order",
            "grid": [vars_of(p) for p in pts], **(meta or {})}
    info["heldout_grid"] = [vars_of(p) for p in held_pts]
    if notes:
        info["grid_notes"] = notes
    knots = tuple(context_knots) if context_knots is not None else default_knots(
        min(max_model_len, kv_tokens))
    cm = fit_cost_model(samples, name=name, fixed=fixed, meta=info,
                        layout=runner_layout(executor, block_size),
                        tie={"decode_pad_token": "context_token"}, experts=experts,
                        context_knots=knots)
    if weights:
        cm = _with_weights(cm, weights)
    cm.fit["regimes"] = regime_errors(cm, samples)
    if held:
        cm.fit["heldout"] = regime_errors(cm, held)
    return cm


def _with_weights(cm: CostModel, weights: dict[str, Any]) -> CostModel:
    """``cm`` with its weights' fields set, and the dense read priced from the fitted
    expert read where that is known (bytes of both and a fitted ``expert_read``)."""
    known = {k: weights[k] for k in ("quantization", "bytes_per_weight", "weight_bytes")
             if k in weights}
    cm = replace(cm, **known)  # fit and meta are the same dicts
    if cm.expert_bytes and cm.expert_read and cm.weight_bytes:
        per_byte = cm.expert_read / cm.expert_bytes
        cm.meta["weight_read_s_per_byte"] = per_byte
        cm.meta["t0_weight_read_s"] = min(cm.t0, per_byte * cm.weight_bytes)
    return cm


__all__ = [
    "ExpertShape",
    "GridPoint",
    "StepSample",
    "calibrate",
    "collect_samples",
    "default_grid",
    "fit_cost_model",
    "fit_to_context",
    "heldout_grid",
    "predict",
    "runner_layout",
    "sample_of",
    "synthetic_samples",
    "vars_of",
]
