"""Reports of simulation runs: a terminal table, a JSON file, PNG plots.

Several runs (``--compare``) become columns of one table and curves of one plot;
a rate sweep becomes throughput and p99 TTFT against offered load.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from iterserve.measure.latency import RequestLatencies
from iterserve.measure.summary import latency_stats
from iterserve.sim.simulator import SimResult

RESULT_SCHEMA = "iterserve.sim.result/v1"

# (label, metrics key path, format)
_ROWS: list[tuple[str, tuple[str, ...], str]] = [
    ("Completed requests", ("num_completed",), "{:,.0f}"),
    ("Rejected requests", ("num_rejected",), "{:,.0f}"),
    ("Duration (s)", ("duration_s",), "{:,.2f}"),
    ("Request throughput (req/s)", ("request_throughput",), "{:,.2f}"),
    ("Output throughput (tok/s)", ("output_token_throughput",), "{:,.1f}"),
    ("Total throughput (tok/s)", ("total_token_throughput",), "{:,.1f}"),
    ("Goodput (req/s)", ("goodput", "requests_per_s"), "{:,.2f}"),
]
for _name, _key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"),
                    ("E2E", "e2e_ms"), ("Queue", "queue_ms")):
    for _s in ("mean", "median", "p90", "p99"):
        _ROWS.append((f"{_name} {_s} (ms)", (_key, _s), "{:,.2f}"))
_ROWS += [
    ("Mean running batch", ("mean_batch_size",), "{:,.1f}"),
    ("Mean KV usage", ("mean_kv_usage",), "{:.1%}"),
    ("Max waiting", ("max_waiting",), "{:,.0f}"),
    ("Preemptions", ("num_preemptions",), "{:,.0f}"),
    ("Prefix-cache hit rate", ("prefix_cache_hit_rate",), "{:.1%}"),
    ("Replica imbalance (max/mean req)", ("replica_imbalance",), "{:.2f}"),
    ("Little's law L", ("littles_law", "L"), "{:,.2f}"),
    ("Little's law λW", ("littles_law", "lambda_W"), "{:,.2f}"),
    ("Engine steps", ("num_steps",), "{:,.0f}"),
    ("Wall time (s)", ("wall_time_s",), "{:,.2f}"),
    ("Sim req / wall s", ("sim_requests_per_wall_s",), "{:,.0f}"),
]


def _get(m: dict, path: tuple[str, ...]) -> Any:
    for k in path:
        if not isinstance(m, dict) or k not in m:
            return None
        m = m[k]
    return m


def _fmt(v: Any, fmt: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    try:
        return fmt.format(v)
    except (ValueError, TypeError):
        return str(v)


def table_rows(columns: Sequence[tuple[str, dict]]) -> list[list[str]]:
    """[["metric", col1, col2, ...], ...] for rows that have a value in some column."""
    rows = [["Metric", *[label for label, _ in columns]]]
    for label, path, fmt in _ROWS:
        vals = [_get(m, path) for _, m in columns]
        if all(v is None for v in vals):
            continue
        rows.append([label, *[_fmt(v, fmt) for v in vals]])
    return rows


def format_table(columns: Sequence[tuple[str, dict]], title: str = "Simulation result") -> str:
    """A plain-text table (one column per run)."""
    rows = table_rows(columns)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    total = sum(widths) + 3 * (len(widths) - 1)
    out = [f" {title} ".center(max(total, len(title) + 2), "=")]
    for j, r in enumerate(rows):
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        out.append("   ".join(cells))
        if j == 0:
            out.append("-" * max(total, len(title) + 2))
    out.append("=" * max(total, len(title) + 2))
    return "\n".join(out)


def print_table(columns: Sequence[tuple[str, dict]], title: str = "Simulation result", *,
                rich: bool = True) -> None:
    if rich:
        try:
            from rich.console import Console
            from rich.table import Table
        except ImportError:  # pragma: no cover - rich is a dependency
            rich = False
    if not rich:
        print(format_table(columns, title))
        return
    rows = table_rows(columns)
    t = Table(title=title)
    t.add_column(rows[0][0])
    for h in rows[0][1:]:
        t.add_column(h, justify="right")
    for r in rows[1:]:
        t.add_row(*r)
    Console().print(t)


# ---------------------------------------------------------------------------
# JSON
# ---------------------------------------------------------------------------


def _json_default(o: Any) -> Any:
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return None if math.isnan(o) else float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def _clean(o: Any) -> Any:
    """NaN -> None so the file is strict JSON."""
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [_clean(v) for v in o]
    if isinstance(o, float | np.floating) and math.isnan(o):
        return None
    return o


def result_dict(r: SimResult, *, with_records: bool = False) -> dict[str, Any]:
    d: dict[str, Any] = {"label": r.label, "config": r.config, "metrics": r.metrics}
    if r.stability is not None:
        s = r.stability
        d["stability"] = {
            "arrival_rate": s.arrival_rate,
            "offered_tokens_per_s": s.offered_tokens_per_s,
            "capacity_tokens_per_s": s.capacity_tokens_per_s,
            "capacity_requests_per_s": s.capacity_requests_per_s,
            "batch_size": s.batch_size,
            "batch_limit": s.batch_limit,
            "utilization": s.utilization,
            "oversubscribed": s.is_oversubscribed,
        }
    if with_records:
        # The bench's record shape (iterserve.bench.metrics.RequestRecord): times from
        # the run's start; no per-request ITLs (the simulator pools them).
        t0 = float(r.arrival.min()) if len(r.arrival) else 0.0
        lat = RequestLatencies.from_times(
            r.arrival, r.first_scheduled, r.first_token, r.finished, r.output_len
        )
        d["records"] = [
            {
                "arrival_time": float(a - t0),
                "send_time": float(a - t0),
                "prompt_len": int(p),
                "output_len": int(o),
                "ttft": float(ttft),
                "itls": [],
                "e2el": float(e2e),
                "success": not math.isnan(e2e),
            }
            for a, p, o, ttft, e2e in zip(r.arrival, r.prompt_len, r.output_len, lat.ttft, lat.e2e)
        ]
    return d


def save_json(path: str | Path, runs: Sequence[SimResult], extra: dict | None = None, *,
              with_records: bool = False) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"schema": RESULT_SCHEMA, **(extra or {}),
           "runs": [result_dict(r, with_records=with_records) for r in runs]}
    path.write_text(json.dumps(_clean(doc), indent=1, default=_json_default) + "\n")
    return path


# ---------------------------------------------------------------------------
# Measured results (``iterserve bench serve``) in the same shape
# ---------------------------------------------------------------------------


def metrics_from_bench_result(path: str | Path) -> dict[str, Any]:
    """A ``bench serve`` result file as a metrics dict comparable with a simulation's."""
    from iterserve.bench.metrics import latencies_of
    from iterserve.bench.results import load_result, records_of

    res = load_result(path)
    recs = [r for r in records_of(res) if r.success]
    duration = float(res.get("duration") or 0.0)
    if not duration and recs:
        duration = max(r.send_time + r.e2el for r in recs) - min(r.send_time for r in recs)
    duration = max(duration, 1e-12)
    out_tok = sum(r.output_len for r in recs)
    lat = latencies_of(recs)
    return {
        "num_completed": len(recs),
        "duration_s": duration,
        "request_throughput": len(recs) / duration,
        "output_token_throughput": out_tok / duration,
        "total_token_throughput": (out_tok + sum(r.prompt_len for r in recs)) / duration,
        "ttft_ms": latency_stats(lat.ttft).as_dict(),
        "tpot_ms": latency_stats(lat.tpot).as_dict(),
        "itl_ms": latency_stats([g for r in recs for g in r.itls]).as_dict(),
        "e2e_ms": latency_stats(lat.e2e).as_dict(),
    }


def is_request_log(path: str | Path) -> bool:
    """A ``serve --request-log`` file (JSON lines) rather than a bench result."""
    return Path(path).suffix in (".jsonl", ".ndjson")


def metrics_from_measured(path: str | Path) -> dict[str, Any]:
    """A measured run as a metrics dict: a bench result, or a server's request log."""
    return metrics_from_request_log(path) if is_request_log(path) else \
        metrics_from_bench_result(path)


def metrics_from_request_log(path: str | Path) -> dict[str, Any]:
    """A ``serve --request-log`` file (the server's own per-request timings) as a metrics
    dict comparable with a simulation's. A record carries its mean ITL, not each gap:
    the ITL mean is exact, its percentiles are those of the per-request means weighted
    by their gaps."""
    from iterserve.measure.request_log import read_request_log

    recs = [r for r in read_request_log(path) if r.get("finish_reason") not in ("abort", "error")]
    if not recs:
        raise ValueError(f"{path}: no finished requests")
    start = min(r["arrival_time"] for r in recs)
    duration = max(max(r["finished_time"] for r in recs) - start, 1e-12)
    nan = math.nan

    def col(key: str) -> list[float]:
        return [nan if r.get(key) is None else float(r[key]) for r in recs]

    out_tok = sum(r["num_output_tokens"] for r in recs)
    lat = RequestLatencies.from_durations(col("ttft"), col("e2e"),
                                          [r["num_output_tokens"] for r in recs], col("queue_time"))
    itls = [float(r["itl_mean"]) for r in recs if r.get("itl_mean") is not None
            for _ in range(int(r.get("num_token_outputs", 2)) - 1)]
    return {
        "num_completed": len(recs),
        "duration_s": duration,
        "request_throughput": len(recs) / duration,
        "output_token_throughput": out_tok / duration,
        "total_token_throughput": (out_tok + sum(r["num_prompt_tokens"] for r in recs)) / duration,
        "ttft_ms": latency_stats(lat.ttft).as_dict(),
        "tpot_ms": latency_stats(lat.tpot).as_dict(),
        "itl_ms": latency_stats(itls).as_dict(),
        "e2e_ms": latency_stats(lat.e2e).as_dict(),
        "queue_ms": latency_stats(lat.queue).as_dict(),
    }


# ---------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _downsample(x: np.ndarray, y: np.ndarray, n: int = 4000) -> tuple[np.ndarray, np.ndarray]:
    if len(x) <= n:
        return x, y
    idx = np.linspace(0, len(x) - 1, n).astype(np.int64)
    return x[idx], y[idx]


def plot_timelines(runs: Sequence[SimResult], path: str | Path) -> Path:
    """Running batch size, KV usage and waiting queue length over simulated time."""
    plt = _plt()
    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    for r in runs:
        t = r.step_time - (r.arrival.min() if len(r.arrival) else 0.0)
        for ax, y in zip(axes, (r.step_batch, r.step_kv_usage * 100, r.step_waiting)):
            xs, ys = _downsample(t, y.astype(np.float64))
            ax.plot(xs, ys, lw=0.8, label=r.label)
    axes[0].set_ylabel("running batch (reqs)")
    axes[1].set_ylabel("KV cache usage (%)")
    axes[2].set_ylabel("waiting requests")
    axes[2].set_xlabel("simulated time (s)")
    axes[0].legend(loc="upper right")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_cdfs(runs: Sequence[SimResult], path: str | Path) -> Path:
    """Latency CDFs: TTFT, TPOT, E2E."""
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for r in runs:
        lat = RequestLatencies.from_times(
            r.arrival, r.first_scheduled, r.first_token, r.finished, r.output_len
        ).select(~np.isnan(r.finished))
        for ax, v in zip(axes, (lat.ttft, lat.tpot[~np.isnan(lat.tpot)], lat.e2e)):
            if len(v):
                xs = np.sort(v) * 1e3
                ax.plot(xs, np.linspace(0, 1, len(xs)), label=r.label)
    for ax, name in zip(axes, ("TTFT", "TPOT", "E2E latency")):
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_sweep(sweep: dict[str, list[tuple[float, dict]]], path: str | Path,
               capacity_rps: float | None = None) -> Path:
    """Throughput and p99 TTFT against offered load, one curve per run label."""
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, pts in sweep.items():
        rates = [p[0] for p in pts]
        a1.plot(rates, [p[1]["request_throughput"] for p in pts], "o-", label=label)
        a2.plot(rates, [p[1]["ttft_ms"]["p99"] for p in pts], "o-", label=label)
    lim = max((p[0] for pts in sweep.values() for p in pts), default=1.0)
    a1.plot([0, lim], [0, lim], "k:", lw=0.8, label="offered")
    for ax in (a1, a2):
        if capacity_rps:
            ax.axvline(capacity_rps, color="grey", ls="--", lw=0.8, label="predicted capacity")
        ax.set_xlabel("offered load (req/s)")
        ax.grid(alpha=0.3)
    a1.set_ylabel("throughput (req/s)")
    a2.set_ylabel("p99 TTFT (ms)")
    a2.set_yscale("log")
    a1.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
