"""Fitting the cost model to timed steps.

A timed step is a ``StepSample``: its shape (the cost model's features, the
attention terms read from the runner's published step layout) and its seconds.
The fit is least squares on relative error (rows weighted by 1/t) with
non-negative coefficients; a runner with a one-token path gets that path's two
coefficients fitted apart. A sample keeps its decode rows' contexts and its prefill
chunks too, from which the long-context columns (``long_context.py``: idle decode
threads, tokens and pairs past each context knot) are computed for the knots a fit asks
for. ``calibrate.py`` produces the samples; ``fit_report.py`` reports the fit's errors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from iterserve.core.outputs import SchedulerOutput
from iterserve.model.step_layout import PAGED, VARLEN, RunnerLayout
from iterserve.sim.cost_model import (
    COEFFICIENTS,
    CostModel,
    attention_work,
    expected_active_experts,
    masked_prefill_pairs,
)
from iterserve.sim.long_context import feature_names, long_context_features, step_rows

FEATURES = COEFFICIENTS
# Kinds of step, each with its own error in a fit report: decode-only, prefill-only,
# prefill chunks beside decodes, and steps of exactly one token.
REGIMES = ("decode", "prefill", "mixed", "one_token")


@dataclass(slots=True)
class StepSample:
    num_prefill_tokens: int
    num_decode_seqs: int
    num_context_tokens: int
    num_swap_blocks: int
    seconds: float
    num_decode_pad_tokens: int = 0
    num_prefill_attn_pairs: int = 0
    # Of the pairs, those of chunks on a cached prefix (masked, not causal).
    num_prefill_masked_pairs: int = 0
    # Timed on a held-out grid point: for the fit's report, never fitted.
    heldout: bool = False
    # Requests in the step (0: unknown, as in samples made before it was recorded);
    # with ``num_context_tokens`` it gives the step's mean context per request, by
    # which ``context_bucket_errors`` buckets steps.
    num_seqs: int = 0
    # The decode rows' contexts (new token included, sorted) and the prefill chunks as
    # (new, computed) tokens: what the long-context columns are computed from (empty in
    # samples built from totals alone, whose long-context columns are then 0).
    decode_contexts: tuple[int, ...] = ()
    prefill_chunks: tuple[tuple[int, int], ...] = ()

    def long_features(self, knots: Sequence[int], threads: int) -> list[int]:
        """The long-context columns for ``knots`` and ``threads`` decode threads."""
        return long_context_features(self.decode_contexts, self.prefill_chunks, knots, threads)

    def features(self) -> list[float]:
        """One value per coefficient (``COEFFICIENTS``): causal and masked pairs apart."""
        return [1.0, self.num_prefill_tokens, self.num_decode_seqs, self.num_context_tokens,
                self.num_swap_blocks, self.num_decode_pad_tokens,
                self.num_prefill_attn_pairs - self.num_prefill_masked_pairs,
                self.num_prefill_masked_pairs]

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_seqs

    @property
    def is_lone(self) -> bool:
        """A step of exactly one token (one decode, or a one-token prompt or chunk)."""
        return self.num_tokens == 1

    @property
    def regime(self) -> str:
        """Which kind of step this is, for the fit's per-regime errors (``REGIMES``)."""
        if self.num_tokens == 1:
            return "one_token"
        if not self.num_prefill_tokens:
            return "decode"
        return "mixed" if self.num_decode_seqs else "prefill"

    @property
    def mean_context(self) -> float:
        """Mean context per request of the step (KV tokens attended, incl. new ones)."""
        n = self.num_seqs or max(1, self.num_decode_seqs + (1 if self.num_prefill_tokens else 0))
        return self.num_context_tokens / n

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_prefill_tokens, self.num_decode_seqs, self.num_context_tokens,
                self.num_swap_blocks, self.num_decode_pad_tokens, self.num_prefill_attn_pairs,
                self.num_prefill_masked_pairs, *self.decode_contexts,
                *(x for chunk in self.prefill_chunks for x in (*chunk, -1)))


@dataclass(frozen=True, slots=True)
class ExpertShape:
    """A mixture-of-experts model's routing, for the fit's expert-read column: each token
    picks ``experts_per_token`` of ``num_experts``; ``expert_bytes`` is one expert's
    weights in every MoE layer at their stored format (0: unknown), recorded with the
    fit so that ``expert_read / expert_bytes`` is seconds per byte of expert weights."""

    num_experts: int
    experts_per_token: int
    expert_bytes: float = 0.0

    def __post_init__(self) -> None:
        if not 1 <= self.experts_per_token <= self.num_experts or self.expert_bytes < 0:
            raise ValueError(f"experts_per_token must be in 1..num_experts "
                             f"({self.num_experts}) and expert_bytes >= 0")

    def column(self, num_tokens: int) -> float:
        """The experts a step of ``num_tokens`` tokens is expected to read (in experts,
        not bytes: a column of the size of the others keeps the least squares well
        conditioned)."""
        return expected_active_experts(num_tokens, self.num_experts, self.experts_per_token)


def runner_layout(executor: object, block_size: int) -> RunnerLayout:
    """The step layout ``executor`` publishes (``ModelRunner.step_layout``). One that
    publishes none (the simulator's executor, a test double) is taken to pad nothing
    and to have no one-token path."""
    layout = getattr(executor, "step_layout", None)
    if layout is None:
        return RunnerLayout(block_size=block_size, attention=VARLEN)
    if not isinstance(layout, RunnerLayout):
        raise TypeError(f"executor.step_layout must be a RunnerLayout, got {type(layout).__name__}")
    if layout.block_size != block_size:
        raise ValueError(f"block_size {block_size} differs from the runner's {layout.block_size}")
    return layout


def sample_of(so: SchedulerOutput, seconds: float, layout: RunnerLayout) -> StepSample:
    """The shape of a step the runner with ``layout`` executed, and its time."""
    pad, pairs = attention_work(so, layout)
    dec, chunks = step_rows(so.num_scheduled_tokens, so.num_computed_tokens)
    return StepSample(so.num_prefill_tokens, so.num_decode_tokens, so.num_context_tokens,
                      len(so.blocks_to_swap_in) + len(so.blocks_to_swap_out), seconds, pad, pairs,
                      masked_prefill_pairs(so) if pairs else 0, num_seqs=so.num_reqs,
                      decode_contexts=dec, prefill_chunks=chunks)


def fit_cost_model(
    samples: Sequence[StepSample],
    *,
    layout: RunnerLayout | None = None,
    **kw,
) -> CostModel:
    """Fit the cost model of the runner with ``layout`` (``_fit_linear`` has the
    details; ``context_knots`` adds the long-context columns). With a one-token path (``layout.lone_token_path``) one-token steps get
    their own two coefficients (``lone_t0``, ``lone_context_token``) and stay out
    of the main fit, whose fixed cost they would otherwise drag down."""
    layout = layout if layout is not None else RunnerLayout(attention=VARLEN)
    kw["layout"] = layout
    lone = [s for s in samples if layout.is_lone_step(s.num_tokens)]
    rest = [s for s in samples if not layout.is_lone_step(s.num_tokens)] if len(lone) >= 2 \
        else list(samples)
    if len(rest) < 2 or len(rest) == len(samples):
        return _fit_linear(samples, **kw)
    cm = _fit_linear(rest, **kw)
    lone_t0, lone_context_token, *lone_excess = _fit_lone(lone, cm.context_knots)
    dropped = cm.fit.get("num_outliers_dropped", 0.0)
    # replace(): the model's layout follows its lone_t0.
    cm = replace(cm, lone_t0=lone_t0, lone_context_token=lone_context_token,
                 lone_excess=tuple(lone_excess))
    cm.fit = _fit_stats(cm, samples)
    cm.fit["num_lone_samples"] = float(len(lone))
    if dropped:
        cm.fit["num_outliers_dropped"] = dropped
    return cm


def predict(cm: CostModel, s: StepSample) -> float:
    """The cost model's time for a timed step shape."""
    if cm.layout.is_lone_step(s.num_tokens):
        return cm.lone_time(s.num_context_tokens) + cm.swap_block * s.num_swap_blocks
    long = s.long_features(cm.context_knots, cm.decode_threads) if cm.has_long_context else ()
    return cm.time_for(s.num_prefill_tokens, s.num_decode_seqs, s.num_context_tokens,
                       s.num_swap_blocks, s.num_decode_pad_tokens, s.num_prefill_attn_pairs,
                       s.num_prefill_masked_pairs, long_context=long)


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


def _fit_lone(samples: Sequence[StepSample], knots: Sequence[int] = ()) -> list[float]:
    """[lone_t0, lone_context_token, *lone_excess]: t = t0 + c * context (+ x_k per token
    past knot k) over one-token steps, least squares on relative error, all >= 0, one
    refit without gross outliers."""
    ctx = np.array([s.num_context_tokens for s in samples], dtype=np.float64)
    y = np.array([s.seconds for s in samples], dtype=np.float64)
    X = np.stack([np.ones(len(y)), ctx, *(np.maximum(ctx - k, 0.0) for k in knots)], axis=1)
    keep = np.ones(len(y), dtype=bool)
    coef = np.zeros(X.shape[1])
    for _ in range(2):
        w = 1.0 / y[keep]
        coef = nnls(X[keep] * w[:, None], y[keep] * w)
        if coef[0] <= 0:
            # Not a zero fixed cost: lone_t0 0 would turn the one-token path off.
            coef = np.zeros(X.shape[1])
            coef[0] = float(np.median(y[keep]))
        rel = np.abs((X @ coef - y) / y)
        mad = float(np.median(rel[keep]))
        new = rel <= max(4 * mad, 0.02)
        if new.sum() < 2 or (new == keep).all():
            break
        keep = new
    return [float(c) for c in coef]


def _fit_linear(
    samples: Sequence[StepSample],
    *,
    name: str = "calibrated",
    fixed: dict[str, float] | None = None,
    meta: dict | None = None,
    robust: bool = True,
    layout: RunnerLayout,
    tie: dict[str, str] | None = None,
    experts: ExpertShape | None = None,
    context_knots: Sequence[int] = (),
) -> CostModel:
    """Non-negative least squares on relative error.

    ``context_knots`` (and a PAGED ``layout`` with several ``decode_threads``) add the
    long-context columns (``long_context.py``): idle decode thread x token slots, and
    per knot the decode KV tokens and the prefill pairs past it. Their coefficients are
    the cost model's ``decode_imbalance_token``, ``decode_excess`` and ``prefill_excess``;
    non-negative, so the fitted cost per token can only rise with a request's context.

    ``experts`` (a MoE model) adds a column: the experts a step's tokens are expected
    to read (``ExpertShape.column``), whose coefficient is ``expert_read`` (seconds
    per expert; over ``expert_bytes``, per byte of expert weights). Its curve over the
    tokens (k per token at first, then saturating at all experts) is what tells it
    apart from ``t0`` and the per-token terms.

    ``tie`` maps a coefficient to another that it must equal (its feature is
    folded into the other's column, one parameter fewer to fit): calibration ties
    ``decode_pad_token`` to ``context_token``, since the runner gathers and attends
    a padded slot exactly as it does a real one, and the noise of a busy machine
    would otherwise trade the two off between runs.
    Coefficients whose feature never varies in the samples (e.g. swaps on a grid
    without any) come from ``fixed`` (default 0). A coefficient the unconstrained
    fit would make negative is 0 (``nnls``). With ``robust``, samples more than 4x the median
    relative error off are dropped and the fit redone once.
    """
    if len(samples) < 2:
        raise ValueError("need at least 2 timed steps to fit")
    fixed = dict(fixed or {})
    tie = dict(tie or {})
    knots = tuple(int(k) for k in context_knots)
    threads = layout.decode_threads if layout.attention == PAGED else 1
    long_names = feature_names(knots) if knots or threads > 1 else ()
    names = (*FEATURES, *long_names, *(("expert_read",) if experts else ()))
    X0 = np.array([s.features() + (s.long_features(knots, threads) if long_names else [])
                   + ([experts.column(s.num_tokens)] if experts else [])
                   for s in samples], dtype=np.float64)
    y = np.array([s.seconds for s in samples], dtype=np.float64)
    if np.any(y <= 0):
        raise ValueError("step times must be > 0")
    X = X0.copy()
    for f, target in tie.items():
        X[:, FEATURES.index(target)] += X[:, FEATURES.index(f)]
        X[:, FEATURES.index(f)] = 0.0
    free = [j for j in range(X.shape[1]) if j == 0 or X[:, j].any()]
    free = [j for j in free if names[j] not in fixed]
    offset = np.zeros_like(y)
    for j, f in enumerate(names):
        if f in fixed:
            offset += fixed[f] * X[:, j]
    w = 1.0 / y  # relative error
    coef = np.zeros(X.shape[1])
    if free:
        coef[free] = nnls(X[:, free] * w[:, None], (y - offset) * w)
    for j, f in enumerate(names):
        if f in fixed:
            coef[j] = fixed[f]
    for f, target in tie.items():
        coef[FEATURES.index(f)] = coef[FEATURES.index(target)]
    masked, causal = FEATURES.index("prefill_attn_masked"), FEATURES.index("prefill_attn")
    if "prefill_attn_masked" not in fixed and not X0[:, masked].any():
        # No masked chunk timed: price one as a causal pair, not as free.
        coef[masked] = coef[causal]
    pred = X0 @ coef
    rel = (pred - y) / y
    if robust and len(y) >= 8:
        # One refit without gross outliers (steps hit by interference), if any.
        mad = float(np.median(np.abs(rel)))
        keep = np.abs(rel) <= max(4 * mad, 0.02)
        if 4 <= keep.sum() < len(y):
            kept = [s for s, k in zip(samples, keep) if k]
            cm = _fit_linear(kept, name=name, fixed=fixed, meta=meta, robust=False,
                             layout=layout, tie=tie, experts=experts, context_knots=knots)
            cm.fit["num_outliers_dropped"] = float(len(y) - keep.sum())
            return cm
    extra: dict[str, Any] = {}
    if long_names:
        long = coef[len(FEATURES):len(FEATURES) + len(long_names)]
        extra.update(context_knots=knots, decode_imbalance_token=float(long[0]),
                   decode_excess=tuple(float(x) for x in long[1:1 + len(knots)]),
                   prefill_excess=tuple(float(x) for x in long[1 + len(knots):]),
                   decode_threads=threads)
    if experts:
        extra.update(expert_read=float(coef[-1]),
                   num_experts=experts.num_experts, experts_per_token=experts.experts_per_token,
                   expert_bytes=float(experts.expert_bytes))
    cm = CostModel.for_layout(layout, **{f: float(c) for f, c in zip(FEATURES, coef)},
                              **extra, name=name, meta=dict(meta or {}))
    cm.fit = {
        "num_samples": float(len(samples)),
        "mean_abs_rel_error": float(np.mean(np.abs(rel))),
        "rms_rel_error": float(np.sqrt(np.mean(rel**2))),
        "max_abs_rel_error": float(np.max(np.abs(rel))),
        "r2": float(1 - np.sum((pred - y) ** 2) / max(np.sum((y - y.mean()) ** 2), 1e-300)),
    }
    return cm



def nnls(A: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||A x - b|| over x >= 0 (Lawson and Hanson's active-set method), on
    columns scaled to unit norm (a fit's columns span 1 to 1e9: steps to pairs)."""
    norms = np.linalg.norm(A, axis=0)
    norms[norms == 0] = 1.0
    A = A / norms
    n = A.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 1e-10 * max(1.0, float(np.linalg.norm(b)))
    for _ in range(3 * n + 10):
        grad = A.T @ (b - A @ x)
        if passive.all() or grad[~passive].max() <= tol:
            break
        passive[int(np.argmax(np.where(passive, -np.inf, grad)))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(A[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                break
            # Step from x toward z as far as x stays >= 0; drop the columns that hit 0.
            neg = passive & (z <= 0)
            alpha = float(np.min(x[neg] / np.maximum(x[neg] - z[neg], 1e-300)))
            x = x + alpha * (z - x)
            passive &= x > 1e-14
            if not passive.any():
                z = np.zeros(n)
                break
        x = z
    return np.maximum(x, 0.0) / norms


def synthetic_samples(
    truth: CostModel, n: int = 200, noise: float = 0.01, seed: int = 0
) -> list[StepSample]:
    """Step times drawn from ``truth`` with multiplicative noise (for tests); a MoE
    ``truth`` prices the experts each step's tokens touch."""
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


# The error reports, where callers have always found them.
from iterserve.sim.fit_report import (  # noqa: E402
    context_bucket_errors,
    context_buckets,
    format_context_bucket_errors,
    format_regime_errors,
    heldout_problems,
    regime_errors,
)

__all__ = [
    "FEATURES",
    "REGIMES",
    "ExpertShape",
    "StepSample",
    "context_bucket_errors",
    "context_buckets",
    "fit_cost_model",
    "format_context_bucket_errors",
    "format_regime_errors",
    "heldout_problems",
    "predict",
    "regime_errors",
    "runner_layout",
    "sample_of",
    "synthetic_samples",
]
