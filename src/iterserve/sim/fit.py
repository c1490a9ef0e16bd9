"""Fitting the cost model to timed steps.

A timed step is a ``StepSample``: its shape (the cost model's features, the
attention terms read from the runner's published step layout) and its seconds.
The fit is least squares on relative error (rows weighted by 1/t) with
non-negative coefficients; a runner with a one-token path gets that path's two
coefficients fitted apart. ``calibrate.py`` produces the samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from iterserve.core.outputs import SchedulerOutput
from iterserve.model.step_layout import VARLEN, RunnerLayout
from iterserve.sim.cost_model import (
    COEFFICIENTS,
    CostModel,
    attention_work,
    expected_active_experts,
    masked_prefill_pairs,
)

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
                self.num_prefill_masked_pairs)


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
    return StepSample(so.num_prefill_tokens, so.num_decode_tokens, so.num_context_tokens,
                      len(so.blocks_to_swap_in) + len(so.blocks_to_swap_out), seconds, pad, pairs,
                      masked_prefill_pairs(so) if pairs else 0, num_seqs=so.num_reqs)


def fit_cost_model(
    samples: Sequence[StepSample],
    *,
    layout: RunnerLayout | None = None,
    **kw,
) -> CostModel:
    """Fit the cost model of the runner with ``layout`` (``_fit_linear`` has the
    details). With a one-token path (``layout.lone_token_path``) one-token steps get
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
    lone_t0, lone_context_token = _fit_lone(lone)
    dropped = cm.fit.get("num_outliers_dropped", 0.0)
    # replace(): the model's layout follows its lone_t0.
    cm = replace(cm, lone_t0=lone_t0, lone_context_token=lone_context_token)
    cm.fit = _fit_stats(cm, samples)
    cm.fit["num_lone_samples"] = float(len(lone))
    if dropped:
        cm.fit["num_outliers_dropped"] = dropped
    return cm


def predict(cm: CostModel, s: StepSample) -> float:
    """The cost model's time for a timed step shape."""
    if cm.layout.is_lone_step(s.num_tokens):
        return cm.lone_time(s.num_context_tokens) + cm.swap_block * s.num_swap_blocks
    return cm.time_for(s.num_prefill_tokens, s.num_decode_seqs, s.num_context_tokens,
                       s.num_swap_blocks, s.num_decode_pad_tokens, s.num_prefill_attn_pairs,
                       s.num_prefill_masked_pairs)


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


def regime_errors(cm: CostModel, samples: Sequence[StepSample]) -> dict[str, dict[str, float]]:
    """The cost model's relative error on ``samples``, per regime and over all ("all"):
    number of steps, mean and max |relative error|, and the mean signed error (the bias:
    above 0, the model prices these steps too high) (regimes without steps left out)."""
    groups: dict[str, list[float]] = {}
    for s in samples:
        err = (predict(cm, s) - s.seconds) / s.seconds
        groups.setdefault(s.regime, []).append(err)
        groups.setdefault("all", []).append(err)
    return {k: {"num_samples": float(len(v)), "mean_abs_rel_error": float(np.mean(np.abs(v))),
                "max_abs_rel_error": float(np.max(np.abs(v))),
                "mean_rel_error": float(np.mean(v))}
            for k in (*REGIMES, "all") if (v := groups.get(k))}


def context_buckets(max_context: int) -> list[int]:
    """Bucket edges (tokens of mean context per request) up to ``max_context``: powers
    of two from 256, the last edge the context itself."""
    edges = [0]
    e = 256
    while e < max_context:
        edges.append(e)
        e *= 2
    edges.append(max(max_context, 1))
    return edges


def context_bucket_errors(cm: CostModel, samples: Sequence[StepSample],
                          edges: Sequence[int]) -> list[dict[str, object]]:
    """The cost model's error on ``samples`` by regime and by mean context per request
    (buckets ``[edges[i], edges[i+1])``; the last one also takes longer contexts): where
    over the context the model misprices which kind of step. One row per non-empty
    (regime, bucket): its bounds, steps, measured and predicted seconds in total, the
    error of the total (time-weighted, what a simulation's clock feels) and the mean
    |relative error| per step."""
    rows: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for s in samples:
        ctx = s.mean_context
        b = next((i for i in range(len(edges) - 1) if ctx < edges[i + 1]), len(edges) - 2)
        rows.setdefault((s.regime, b), []).append((s.seconds, predict(cm, s)))
    out: list[dict[str, object]] = []
    for regime in REGIMES:
        for b in range(len(edges) - 1):
            v = rows.get((regime, b))
            if not v:
                continue
            y = np.array([a for a, _ in v])
            p = np.array([c for _, c in v])
            out.append({"regime": regime, "context_lo": int(edges[b]),
                        "context_hi": int(edges[b + 1]), "num_samples": len(v),
                        "measured_s": float(y.sum()), "predicted_s": float(p.sum()),
                        "total_rel_error": float((p.sum() - y.sum()) / y.sum()),
                        "mean_abs_rel_error": float(np.mean(np.abs((p - y) / y)))})
    return out


def format_context_bucket_errors(rows: Sequence[dict]) -> str:
    """``context_bucket_errors``' rows as a table."""
    lines = [f"{'regime':<11}{'context':>13}{'steps':>7}{'measured s':>12}{'predicted s':>13}"
             f"{'total err':>11}{'mean |err|':>12}"]
    for r in rows:
        ctx = f"{r['context_lo']}-{r['context_hi']}"
        lines.append(f"{r['regime']:<11}{ctx:>13}{r['num_samples']:>7}{r['measured_s']:>12.3f}"
                     f"{r['predicted_s']:>13.3f}{r['total_rel_error']:>+11.1%}"
                     f"{r['mean_abs_rel_error']:>12.1%}")
    return "\n".join(lines)


def heldout_problems(fit: dict, max_error: float) -> list[str]:
    """Why a fit's held-out error is too poor to trust (empty: fine, or nothing was
    held out): each regime whose mean |relative error| on steps the fit never saw
    exceeds ``max_error``."""
    held = fit.get("heldout") or {}
    return [f"{k}: mean |err| {v['mean_abs_rel_error']:.1%} over {int(v['num_samples'])} "
            f"held-out steps (max {v['max_abs_rel_error']:.1%})"
            for k, v in held.items() if k != "all" and v["mean_abs_rel_error"] > max_error]


def format_regime_errors(fit: dict) -> str:
    """The fit report's per-regime table: in-sample (fitted) and held-out errors."""
    lines = [f"{'regime':<11}{'fitted: n':>10}{'mean':>8}{'max':>8}"
             f"{'held out: n':>13}{'mean':>8}{'max':>8}"]
    own, held = fit.get("regimes") or {}, fit.get("heldout") or {}
    for k in (*REGIMES, "all"):
        if k not in own and k not in held:
            continue
        cells = ""
        for d, w in ((own.get(k), 10), (held.get(k), 13)):
            cells += (f"{int(d['num_samples']):>{w}}{d['mean_abs_rel_error']:>8.1%}"
                      f"{d['max_abs_rel_error']:>8.1%}") if d else f"{'-':>{w}}{'-':>8}{'-':>8}"
        lines.append(f"{k:<11}{cells}")
    return "\n".join(lines)


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
        elif t0 <= 0:
            # Not a zero fixed cost: lone_t0 0 would turn the one-token path off.
            t0, c = float(np.median(y[keep])), 0.0
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
    layout: RunnerLayout,
    tie: dict[str, str] | None = None,
    experts: ExpertShape | None = None,
) -> CostModel:
    """Non-negative least squares on relative error.

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
    fit makes negative is pinned to 0 and the rest refitted (active-set NNLS,
    enough for seven columns). With ``robust``, samples more than 4x the median
    relative error off are dropped and the fit redone once.
    """
    if len(samples) < 2:
        raise ValueError("need at least 2 timed steps to fit")
    fixed = dict(fixed or {})
    tie = dict(tie or {})
    names = (*FEATURES, "expert_read") if experts else FEATURES
    X0 = np.array([s.features() + ([experts.column(s.num_tokens)] if experts else [])
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
                             layout=layout, tie=tie, experts=experts)
            cm.fit["num_outliers_dropped"] = float(len(y) - keep.sum())
            return cm
    moe: dict[str, float | int] = {}
    if experts:
        moe = dict(expert_read=float(coef[len(FEATURES)]),
                   num_experts=experts.num_experts, experts_per_token=experts.experts_per_token,
                   expert_bytes=float(experts.expert_bytes))
    cm = CostModel.for_layout(layout, **{f: float(c) for f, c in zip(FEATURES, coef)},
                              **moe, name=name, meta=dict(meta or {}))
    cm.fit = {
        "num_samples": float(len(samples)),
        "mean_abs_rel_error": float(np.mean(np.abs(rel))),
        "rms_rel_error": float(np.sqrt(np.mean(rel**2))),
        "max_abs_rel_error": float(np.max(np.abs(rel))),
        "r2": float(1 - np.sum((pred - y) ** 2) / max(np.sum((y - y.mean()) ** 2), 1e-300)),
    }
    return cm



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
