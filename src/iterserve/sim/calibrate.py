"""Calibration: time a real executor over a grid of batch shapes and fit the cost model.

The shapes are produced by the production ``Scheduler`` (through ``EngineCore``),
so every timed step is a real ``SchedulerOutput``: B requests with C-token
prompts are prefilled in chunks of at most the token budget (prefill and mixed
samples), then decode together for a few steps (decode samples at context ~C). Every
other grid point spreads its prompt lengths, so decode batches of unequal
contexts (padded in the runner's decode groups) and prefill steps packing
several prompts are sampled too. Each ``execute`` call (or, with ``whole_step``,
each ``EngineCore.step``) is timed; a shape's median over repeats is fitted by
least squares on relative error (rows weighted by 1/t), non-negative coefficients.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from iterserve.config import CacheConfig, SchedulerConfig
from iterserve.core.executor import Executor
from iterserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from iterserve.core.request import Request
from iterserve.core.sampling_params import SamplingParams
from iterserve.sim.cost_model import COEFFICIENTS, CostModel, attention_work

FEATURES = COEFFICIENTS


@dataclass(slots=True)
class StepSample:
    num_prefill_tokens: int
    num_decode_seqs: int
    num_context_tokens: int
    num_swap_blocks: int
    seconds: float
    num_decode_pad_tokens: int = 0
    num_prefill_attn_pairs: int = 0

    def features(self) -> list[float]:
        return [1.0, self.num_prefill_tokens, self.num_decode_seqs, self.num_context_tokens,
                self.num_swap_blocks, self.num_decode_pad_tokens, self.num_prefill_attn_pairs]

    @property
    def is_lone(self) -> bool:
        """A step of exactly one token (one decode, or a one-token prompt or chunk)."""
        return self.num_prefill_tokens + self.num_decode_seqs == 1

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_prefill_tokens, self.num_decode_seqs, self.num_context_tokens,
                self.num_swap_blocks, self.num_decode_pad_tokens, self.num_prefill_attn_pairs)


def sample_of(so: SchedulerOutput, seconds: float, block_size: int = 16,
              decode_group_size: int = 0) -> StepSample:
    pad, pairs = attention_work(so, block_size, decode_group_size)
    return StepSample(so.num_prefill_tokens, so.num_decode_tokens, so.num_context_tokens,
                      len(so.blocks_to_swap_in) + len(so.blocks_to_swap_out), seconds, pad, pairs)


def runner_decode_group_size(executor: object) -> int:
    """How many decodes the runner pads into one attention call (0: none, a fused kernel)."""
    if getattr(executor, "use_flash", False):
        return 0
    return int(getattr(executor, "DECODE_GROUP_SIZE", 0) or 0)


def runner_has_lone_path(executor: object) -> bool:
    """Whether the runner runs one-token steps on a path of their own (the CPU
    runner's C++ decoder), which the cost model then fits apart."""
    return getattr(executor, "decoder", None) is not None


def fit_cost_model(
    samples: Sequence[StepSample],
    *,
    lone_path: bool = False,
    **kw,
) -> CostModel:
    """Fit the cost model (``_fit_linear`` has the details). ``lone_path``: the
    runner has a one-token path (``runner_has_lone_path``), so one-token steps get
    their own two coefficients (``lone_t0``, ``lone_context_token``) and stay out
    of the main fit, whose fixed cost they would otherwise drag down."""
    lone = [s for s in samples if s.is_lone] if lone_path else []
    rest = [s for s in samples if not s.is_lone] if len(lone) >= 2 else list(samples)
    if len(rest) < 2 or len(rest) == len(samples):
        return _fit_linear(samples, **kw)
    cm = _fit_linear(rest, **kw)
    cm.lone_t0, cm.lone_context_token = _fit_lone(lone)
    dropped = cm.fit.get("num_outliers_dropped", 0.0)
    cm.fit = _fit_stats(cm, samples)
    cm.fit["num_lone_samples"] = float(len(lone))
    if dropped:
        cm.fit["num_outliers_dropped"] = dropped
    return cm


def predict(cm: CostModel, s: StepSample) -> float:
    """The cost model's time for a timed step shape."""
    if cm.lone_t0 and s.is_lone:
        return cm.lone_time(s.num_context_tokens) + cm.swap_block * s.num_swap_blocks
    return cm.time_for(s.num_prefill_tokens, s.num_decode_seqs, s.num_context_tokens,
                       s.num_swap_blocks, s.num_decode_pad_tokens, s.num_prefill_attn_pairs)


def _fit_stats(cm: CostModel, samples: Sequence[StepSample]) -> dict[str, float]:
    y = np.array([s.seconds for s in samples])
    pred = np.array([predict(cm, s) for s in samples])
    rel = (pred - y) / y
    return {
        "num_samples": float(len(samples)),
        "mean_abs_rel_error": float(np.mean(np.abs(rel))),
        "rms_rel_error": float(np.sqrt(np.mean(rel**2))),
        "max_abs_rel_error": float(np.max(np.abs(rel))),
        "r2": float(1 - np.sum((pred - y) ** 2) / max(np.sum((y - y.mean()) ** 2), 1e-300)),
    }


def _fit_lone(samples: Sequence[StepSample]) -> tuple[float, float]:
    """(lone_t0, lone_context_token): t = t0 + c * context over one-token steps, least
    squares on relative error, both >= 0, one refit without gross outliers."""
    ctx = np.array([s.num_context_tokens for s in samples], dtype=np.float64)
    y = np.array([s.seconds for s in samples], dtype=np.float64)
    keep = np.ones(len(y), dtype=bool)
    for _ in range(2):
        w = 1.0 / y[keep]
        A = np.stack([np.ones(keep.sum()), ctx[keep]], axis=1) * w[:, None]
        (t0, c), *_ = np.linalg.lstsq(A, y[keep] * w, rcond=None)
        if c < 0 or not ctx[keep].any():
            t0, c = float(np.median(y[keep])), 0.0
        elif t0 < 0:
            t0, c = 0.0, float(np.median(y[keep] / np.maximum(ctx[keep], 1)))
        rel = np.abs((t0 + c * ctx - y) / y)
        mad = float(np.median(rel[keep]))
        new = rel <= max(4 * mad, 0.02)
        if new.sum() < 2 or (new == keep).all():
            break
        keep = new
    return float(t0), float(c)


def _fit_linear(
    samples: Sequence[StepSample],
    *,
    name: str = "calibrated",
    fixed: dict[str, float] | None = None,
    meta: dict | None = None,
    robust: bool = True,
    block_size: int = 16,
    decode_group_size: int = 0,
    tie: dict[str, str] | None = None,
) -> CostModel:
    """Non-negative least squares on relative error.

    ``tie`` maps a coefficient to another that it must equal (its feature is
    folded into the other's column, one parameter fewer to fit): calibration ties
    ``decode_pad_token`` to ``context_token``, since the runner gathers and attends
    a padded slot exactly as it does a real one, and the noise of a busy machine
    would otherwise trade the two off between runs.
    Coefficients whose feature never varies in the samples (e.g. swaps on a grid
    without any) come from ``fixed`` (default 0). A coefficient the unconstrained
    fit makes negative is pinned to 0 and the rest refitted (active-set NNLS,
    enough for seven columns). With ``robust``, samples more than 4x the median
    relative error off are dropped and the fit redone once.
    """
    if len(samples) < 2:
        raise ValueError("need at least 2 timed steps to fit")
    fixed = dict(fixed or {})
    tie = dict(tie or {})
    X0 = np.array([s.features() for s in samples], dtype=np.float64)
    y = np.array([s.seconds for s in samples], dtype=np.float64)
    if np.any(y <= 0):
        raise ValueError("step times must be > 0")
    X = X0.copy()
    for f, target in tie.items():
        X[:, FEATURES.index(target)] += X[:, FEATURES.index(f)]
        X[:, FEATURES.index(f)] = 0.0
    free = [j for j in range(X.shape[1]) if j == 0 or X[:, j].any()]
    free = [j for j in free if FEATURES[j] not in fixed]
    offset = np.zeros_like(y)
    for j, f in enumerate(FEATURES):
        if f in fixed:
            offset += fixed[f] * X[:, j]
    w = 1.0 / y  # relative error
    coef = np.zeros(X.shape[1])
    active = list(free)
    while active:
        A = X[:, active] * w[:, None]
        b = (y - offset) * w
        sol, *_ = np.linalg.lstsq(A, b, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))  # pin the most negative to 0 and refit
    for j, f in enumerate(FEATURES):
        if f in fixed:
            coef[j] = fixed[f]
    for f, target in tie.items():
        coef[FEATURES.index(f)] = coef[FEATURES.index(target)]
    pred = X0 @ coef
    rel = (pred - y) / y
    if robust and len(y) >= 8:
        # One refit without gross outliers (steps hit by interference), if any.
        mad = float(np.median(np.abs(rel)))
        keep = np.abs(rel) <= max(4 * mad, 0.02)
        if 4 <= keep.sum() < len(y):
            kept = [s for s, k in zip(samples, keep) if k]
            cm = _fit_linear(kept, name=name, fixed=fixed, meta=meta, robust=False,
                                block_size=block_size, decode_group_size=decode_group_size,
                                tie=tie)
            cm.fit["num_outliers_dropped"] = float(len(y) - keep.sum())
            return cm
    cm = CostModel(**{f: float(c) for f, c in zip(FEATURES, coef)}, name=name,
                   meta=dict(meta or {}), block_size=block_size,
                   decode_group_size=decode_group_size)
    cm.fit = {
        "num_samples": float(len(samples)),
        "mean_abs_rel_error": float(np.mean(np.abs(rel))),
        "rms_rel_error": float(np.sqrt(np.mean(rel**2))),
        "max_abs_rel_error": float(np.max(np.abs(rel))),
        "r2": float(1 - np.sum((pred - y) ** 2) / max(np.sum((y - y.mean()) ** 2), 1e-300)),
    }
    return cm


# ---------------------------------------------------------------------------
# Timing a real executor
# ---------------------------------------------------------------------------


class TimingExecutor:
    """Wraps an executor and records one StepSample per execute()."""

    def __init__(self, inner: Executor, sync: Callable[[], None] | None = None,
                 block_size: int = 16) -> None:
        self.inner = inner
        self.block_size = block_size
        self.decode_group_size = runner_decode_group_size(inner)
        self.sync = sync  # e.g. torch.cuda.synchronize, so the timer sees the whole step
        self.samples: list[StepSample] = []
        self.record = True

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
            self.samples.append(sample_of(so, dt, self.block_size, self.decode_group_size))
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
    long ones (padding)."""
    chunks = (64, 512, 2048, 256, 1024)
    if quick:
        steps = 4
        points = [(1, 64, 256, 0.0), (1, 512, 2048, 0.0), (8, 64, 2048, 0.0),
                  (8, 512, 256, 0.75), (16, 512, 2048, 0.0), (32, 64, 256, 0.0),
                  (32, 512, 2048, 0.75)]
    else:
        steps = 8
        points = []
        # Small batches twice over (2, 8): below ~8 sequences a decode step's cost bends
        # away from the line the large batches draw, and batch 1 has a path of its own.
        for i, b in enumerate((1, 2, 4, 8, 16, 32, 64)):
            for j, c in enumerate((64, 256, 512, 1024, 2048)):
                spread = 0.75 if b > 1 and ((i + j) % 2 or c >= max_context) else 0.0
                points.append((b, c, chunks[(i + j) % len(chunks)], spread))
    grid = []
    for b, c, chunk, spread in points:
        if c > max_context:
            continue
        chunk = max(chunk, min((x for x in chunks if 16 * x >= b * c), default=max(chunks)))
        if kv_tokens is not None:
            # prompts (mean length c * (1 - spread / 2)) + outputs (prefill + decode steps)
            room = kv_tokens * 0.9 / b - (b * c // chunk + steps + 2)
            c = min(c, int(room / (1 - spread / 2)))
            if c < 16:
                continue
        grid.append(GridPoint(b, c, chunk, steps, spread))
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
) -> list[StepSample]:
    """Drive ``executor`` through the real EngineCore over ``grid``; return timed steps.

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
    points = [p for p in grid for _ in range(repeats)]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(points), desc="calibrate", unit="shape")
    uid = 0
    for k, p in enumerate(points):
        sc = SchedulerConfig(
            max_num_seqs=p.batch_size,
            max_num_batched_tokens=max(p.chunk, p.batch_size),
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
        params = SamplingParams(max_tokens=p.decode_steps + prefill_steps + 1, ignore_eos=True,
                                temperature=0.0)
        # The very first shape runs twice, unrecorded then recorded: first steps pay
        # one-off costs (allocations, kernel selection) a serving engine pays once.
        for record in ([False, True] if k == 0 and warmup else [True]):
            timer.record = record and not whole_step
            lens = np.linspace(p.context_len * (1 - p.spread), p.context_len, p.batch_size)
            for length in rng.permutation(np.maximum(lens.round().astype(int), 1)).tolist():
                ids = rng.integers(10, vocab_size - 10, size=length).tolist()
                if processor is None:
                    engine.add_request(Request(f"cal{uid}", ids, params, 0.0))
                else:
                    for r in processor.add_request(f"cal{uid}", [ids], params, 0.0):
                        engine.add_request(r)
                uid += 1
            while engine.has_unfinished_requests():
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
                    samples.append(sample_of(so, dt, block_size, timer.decode_group_size))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return _median_per_shape(samples)


def _median_per_shape(samples: list[StepSample]) -> list[StepSample]:
    """One sample per distinct step shape, its median time over repeats.

    The simulator must predict the wall time of ordinary steps, so the typical
    (median) time is the target; the minimum of a few repeats sits a few percent
    below it (4.5% at 2 repeats on a 2-core CPU). Steps hit hard by interference
    are still outvoted here, and dropped by the robust refit if they stand alone.
    """
    groups: dict[tuple[int, ...], list[StepSample]] = {}
    for s in samples:
        groups.setdefault(s.shape, []).append(s)
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
) -> CostModel:
    """Time ``executor`` over the grid and fit; ``swap_block`` pins the swap cost
    (the grid does no swaps, so it cannot be fitted from these samples).
    ``samples_out``, if given, receives the timed step shapes that were fitted."""
    max_ctx = max(16, min(2048, max_model_len // 2, num_gpu_blocks * block_size // 64))
    pts = list(grid) if grid is not None else default_grid(
        quick, max_context=max_ctx, kv_tokens=num_gpu_blocks * block_size)
    samples = collect_samples(
        executor, pts, num_gpu_blocks=num_gpu_blocks, block_size=block_size,
        max_model_len=max_model_len, vocab_size=vocab_size, repeats=repeats, sync=sync,
        progress=progress, whole_step=whole_step, tokenizer=tokenizer,
    )
    if samples_out is not None:
        samples_out.extend(samples)
    fixed = {"swap_block": swap_block if swap_block is not None else 0.0}
    info = {"source": "calibration", "timed": "engine step" if whole_step else "executor",
            "grid": [vars_of(p) for p in pts], **(meta or {})}
    return fit_cost_model(samples, name=name, fixed=fixed, meta=info, block_size=block_size,
                          decode_group_size=runner_decode_group_size(executor),
                          tie={"decode_pad_token": "context_token"},
                          lone_path=runner_has_lone_path(executor))


def vars_of(p: GridPoint) -> dict[str, int]:
    return {"batch_size": p.batch_size, "context_len": p.context_len, "chunk": p.chunk,
            "decode_steps": p.decode_steps, "spread": p.spread}


def synthetic_samples(
    truth: CostModel, n: int = 200, noise: float = 0.01, seed: int = 0
) -> list[StepSample]:
    """Step times drawn from ``truth`` with multiplicative noise (for tests)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        kind = rng.integers(0, 3)
        b = int(rng.integers(1, 129))
        ctx_per = int(rng.integers(16, 4096))
        p = int(rng.integers(1, 2049)) if kind != 1 else 0
        d = b if kind != 0 else 0
        ctx = d * ctx_per + (p + int(rng.integers(0, 2048)) if p else 0)
        s = int(rng.integers(0, 64)) if rng.random() < 0.2 else 0
        t = truth.time_for(p, d, ctx, s) * (1 + noise * rng.standard_normal())
        out.append(StepSample(p, d, ctx, s, max(t, 1e-9)))
    return out


__all__ = [
    "GridPoint",
    "StepSample",
    "calibrate",
    "collect_samples",
    "default_grid",
    "fit_cost_model",
    "predict",
    "runner_has_lone_path",
    "synthetic_samples",
]
