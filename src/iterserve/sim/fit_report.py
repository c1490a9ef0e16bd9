"""The fit's error reports: per regime (fitted and held-out steps) and per regime x
context bucket, as numbers and as tables (``fit.py`` re-exports them)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from iterserve.sim.cost_model import CostModel
from iterserve.sim.fit import REGIMES, StepSample, predict


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
