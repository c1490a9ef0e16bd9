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
features, and its one-token path, if any, is fitted apart.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from iterserve.config import CacheConfig, SchedulerConfig
from iterserve.core.executor import Executor
from iterserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from iterserve.core.request import Request
from iterserve.core.sampling_params import SamplingParams
from iterserve.sim.cost_model import CostModel
from iterserve.sim.fit import (
    StepSample,
    fit_cost_model,
    predict,
    regime_errors,
    runner_layout,
    sample_of,
    synthetic_samples,
)

# ---------------------------------------------------------------------------
# Timing a real executor
# ---------------------------------------------------------------------------


class TimingExecutor:
    """Wraps an executor and records one StepSample per execute()."""

    def __init__(self, inner: Executor, sync: Callable[[], None] | None = None,
                 block_size: int = 16) -> None:
        self.inner = inner
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


@dataclass(slots=True)
class GridPoint:
    batch_size: int  # requests decoding together
    context_len: int  # prompt length of each
    chunk: int  # max_num_batched_tokens while prefilling
    decode_steps: int = 8
    # Prompt lengths spread evenly over [context_len * (1 - spread), context_len]:
    # decodes of unequal contexts (padding in the runner's decode groups) and
    # prefill steps packing several prompts of different lengths.
    spread: float = 0.0
    # A prompt of this many tokens arriving once the batch decodes: its chunks run
    # beside ``batch_size`` decodes (mixed steps, as a long prompt arriving on a
    # busy server is computed). 0: none.
    late_prompt: int = 0


def default_grid(quick: bool = False, max_context: int = 2048,
                 kv_tokens: int | None = None) -> list[GridPoint]:
    """Batch size x context length, with prefill chunks from 64 tokens to 2048
    (several prompts per step) and every other point's prompt lengths spread, so
    that the grid covers the decode batch x context plane up to 64 sequences, mixed
    prefill + decode steps, and padded decode groups. A point's chunk is at least
    1/16 of its prompt tokens (at most ~16 prefill steps); ``kv_tokens`` (the KV
    cache's capacity) caps batch x context so calibration never preempts.

    The quick grid keeps the three kinds of decode cost apart with few points:
    uniform short and long contexts (per sequence, per context token) and spread
    long ones (padding), and spans batches up to 64 (held-out shapes lie inside)."""
    chunks = (64, 512, 2048, 256, 1024)
    if quick:
        steps = 4
        points = [(1, 64, 256, 0.0), (1, 512, 2048, 0.0), (8, 64, 2048, 0.0),
                  (8, 512, 256, 0.75), (16, 512, 2048, 0.0), (32, 64, 256, 0.0),
                  (32, 512, 2048, 0.75), (64, 128, 2048, 0.0),
                  # long prompts: whole (causal) and chunked on long prefixes (masked)
                  (2, 2048, 2048, 0.0), (4, 1536, 1024, 0.5)]
    else:
        steps = 8
        points = []
        # Small batches twice over (2, 8): below ~8 sequences a decode step's cost bends
        # away from the line the large batches draw, and batch 1 has a path of its own.
        # Contexts up to the model's own: long contexts are where decode's KV read and
        # attention's quadratic part dominate, and a fit that never saw them extrapolates.
        long = tuple(c for c in (4096, 8192, 16384, 32768) if c < max_context)
        contexts = (64, 256, 512, 1024, 2048, *long,
                    *((max_context,) if max_context > 2048 else ()))
        for i, b in enumerate((1, 2, 4, 8, 16, 32, 64)):
            for j, c in enumerate(contexts):
                if c > 2048 and b > 8:
                    continue  # the KV pool caps these anyway; small batches cover the range
                spread = 0.75 if b > 1 and ((i + j) % 2 or c >= max_context) else 0.0
                points.append((b, c, chunks[(i + j) % len(chunks)], spread))
    grid = []
    seen = set()
    for b, c, chunk, spread in points:
        # The longest contexts are clipped to what the model and pool allow, not
        # dropped: long prompts are where attention's quadratic part shows.
        c = min(c, max_context)
        if (b, c, spread) in seen:
            continue
        seen.add((b, c, spread))
        chunk = max(chunk, min((x for x in chunks if 16 * x >= b * c), default=max(chunks)))
        if kv_tokens is not None:
            # prompts (mean length c * (1 - spread / 2)) + outputs (prefill + decode steps)
            room = kv_tokens * 0.9 / b - (b * c // chunk + steps + 2)
            c = min(c, int(room / (1 - spread / 2)))
            if c < 16:
                continue
        grid.append(GridPoint(b, c, chunk, steps, spread))
    return grid


def heldout_grid(quick: bool = False, max_context: int = 2048,
                 kv_tokens: int | None = None) -> list[GridPoint]:
    """Shapes the default grid never times, to measure how the fit generalises:
    batch sizes, contexts and chunk sizes between its points, long contexts, and
    long prompts chunked beside many decodes (``late_prompt``), the steps a server
    runs when long prompts arrive while others decode."""
    if quick:
        steps = 3
        points = [(3, 384, 384, 0.0, 0), (12, 768, 768, 0.5, 0), (24, 96, 128, 0.5, 0),
                  (16, 256, 768, 0.5, 1536), (48, 160, 384, 0.5, 1024)]
    else:
        steps = 4
        points = [(3, 384, 384, 0.0, 0), (6, 1536, 1536, 0.5, 0), (12, 768, 768, 0.5, 0),
                  (24, 96, 128, 0.5, 0), (40, 192, 768, 0.0, 0), (2, 1800, 384, 0.0, 0),
                  (16, 256, 768, 0.5, 1536), (48, 160, 384, 0.5, 1024),
                  (32, 640, 1536, 0.5, 1900), (8, 1200, 192, 0.5, 700)]
    grid = []
    for b, c, chunk, spread, late in points:
        c, late = min(c, max_context), min(late, max_context)
        if kv_tokens is not None:
            room = kv_tokens * 0.9 - late - 64
            c = min(c, int(room / b / (1 - spread / 2)) - (b * c // chunk + steps + 2))
            if c < 16:
                continue
        grid.append(GridPoint(b, c, chunk, steps, spread, late))
    return grid


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
) -> list[StepSample]:
    """Drive ``executor`` through the real EngineCore over ``grid``; return timed steps.

    ``heldout`` points run interleaved with ``grid``'s (so a machine that slows down
    midway slows both alike); their steps come back marked ``heldout``.

    ``whole_step`` times ``EngineCore.step()`` (schedule + execute + update) and the
    output processor's detokenization with ``tokenizer``: the time a served step
    takes, which is what a simulation of the engine must reproduce. Otherwise only
    ``executor.execute``.
    """
    from iterserve.engine.core import EngineCore
    from iterserve.engine.output_processor import OutputProcessor

    timer = TimingExecutor(executor, sync, block_size)
    samples = timer.samples
    perf = time.perf_counter
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
    for k, (p, is_held) in enumerate(points):
        timer.heldout = is_held
        late = p.late_prompt
        sc = SchedulerConfig(
            max_num_seqs=p.batch_size + (1 if late else 0),
            # With a late prompt its chunks are ``chunk`` tokens beside the decodes.
            max_num_batched_tokens=max(p.chunk, p.batch_size) + (p.batch_size if late else 0),
            max_model_len=max_model_len,
        )
        # Prefix caching off: every prompt must really be computed.
        cc = CacheConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks,
                         enable_prefix_caching=False)
        engine = EngineCore(sc, cc, timer)
        processor = OutputProcessor(tokenizer) if tokenizer is not None else None
        # Early members decode while later ones prefill; long enough outputs leave
        # ``decode_steps`` steps with the whole batch decoding after the last prefill.
        prefill_steps = -(-p.batch_size * p.context_len // sc.max_num_batched_tokens)
        late_steps = -(-late // p.chunk) if late else 0
        params = SamplingParams(max_tokens=p.decode_steps + prefill_steps + late_steps + 1,
                                ignore_eos=True, temperature=0.0)
        # The very first shape runs twice, unrecorded then recorded: first steps pay
        # one-off costs (allocations, kernel selection) a serving engine pays once.
        for record in ([False, True] if k == 0 and warmup else [True]):
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
                so = engine.last_scheduler_output
                if record and so is not None and so.scheduled_requests:
                    samples.append(replace(sample_of(so, dt, timer.layout), heldout=is_held))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return _median_per_shape(samples)


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
) -> CostModel:
    """Time ``executor`` over the grid and fit; ``swap_block`` pins the swap cost
    (the grid does no swaps, so it cannot be fitted from these samples).
    ``samples_out``, if given, receives the timed step shapes that were fitted.

    ``heldout`` (True: ``heldout_grid``; or points; False: none) is timed too but
    not fitted: the fit report (``cm.fit``) gives the error per regime on the
    fitted steps (``"regimes"``) and on these (``"heldout"``), which
    ``heldout_out`` receives."""
    # A grid prompt leaves room for its outputs (prefill + decode steps) in the context;
    # the grid caps each point's batch x context to the KV pool itself.
    # Room beside the prompt for its outputs: one per prefill step (at most 64 on the
    # grid) plus the decode steps and a late prompt's steps.
    max_ctx = max(16, min(max_model_len - 128, num_gpu_blocks * block_size // 2))
    kv_tokens = num_gpu_blocks * block_size
    pts = list(grid) if grid is not None else default_grid(
        quick, max_context=max_ctx, kv_tokens=kv_tokens)
    held_pts = (heldout_grid(quick, max_context=max_ctx, kv_tokens=kv_tokens)
                if heldout is True else list(heldout or []))
    timed = collect_samples(
        executor, pts, num_gpu_blocks=num_gpu_blocks, block_size=block_size,
        max_model_len=max_model_len, vocab_size=vocab_size, repeats=repeats, sync=sync,
        progress=progress, whole_step=whole_step, tokenizer=tokenizer, heldout=held_pts,
    )
    samples = [s for s in timed if not s.heldout]
    held = [s for s in timed if s.heldout]
    if samples_out is not None:
        samples_out.extend(samples)
    if heldout_out is not None:
        heldout_out.extend(held)
    fixed = {"swap_block": swap_block if swap_block is not None else 0.0}
    info = {"source": "calibration", "timed": "engine step" if whole_step else "executor",
            "grid": [vars_of(p) for p in pts], **(meta or {})}
    info["heldout_grid"] = [vars_of(p) for p in held_pts]
    cm = fit_cost_model(samples, name=name, fixed=fixed, meta=info,
                        layout=runner_layout(executor, block_size),
                        tie={"decode_pad_token": "context_token"})
    cm.fit["regimes"] = regime_errors(cm, samples)
    if held:
        cm.fit["heldout"] = regime_errors(cm, held)
    return cm


def vars_of(p: GridPoint) -> dict[str, float]:
    return {"batch_size": p.batch_size, "context_len": p.context_len, "chunk": p.chunk,
            "decode_steps": p.decode_steps, "spread": p.spread, "late_prompt": p.late_prompt}


__all__ = [
    "GridPoint",
    "StepSample",
    "calibrate",
    "collect_samples",
    "default_grid",
    "fit_cost_model",
    "heldout_grid",
    "predict",
    "runner_layout",
    "sample_of",
    "synthetic_samples",
]
