"""``iterserve bench plot``: several result files side by side in one PNG.

Reads measured (``bench serve``) and simulated (``simulate --save-records``,
one curve per run) results alike, and vLLM's own result files: CDFs of TTFT, TPOT, ITL and E2E latency, bars of
request and output-token throughput, and output tokens completed over time.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from iterserve.bench.results import load_results, records_of


def _label(result: dict, path: str) -> str:
    label = result.get("label")
    if label:
        return str(label)
    source = result.get("source")
    stem = Path(path).stem
    return f"{stem} ({source})" if source and source != "measured" else stem


def _cdf(ax, values_s: list[float], label: str) -> None:
    if not values_s:
        return
    x = np.sort(np.asarray(values_s) * 1000.0)
    y = np.arange(1, len(x) + 1) / len(x)
    ax.step(x, y, where="post", label=label)


def plot_results(
    paths: list[str], output: str | Path, labels: list[str] | None = None
) -> Path:
    """Draw every result in ``paths`` into ``output`` (PNG); returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not paths:
        raise ValueError("no result files to plot")
    loaded = [(r, p) for p in paths for r in load_results(p)]
    results = [r for r, _ in loaded]
    if labels is not None and len(labels) != len(results):
        raise ValueError(f"{len(labels)} labels for {len(results)} runs")
    names = labels or [_label(r, p) for r, p in loaded]
    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    panels = [
        ("ttft", "TTFT (ms)", axes[0][0]),
        ("tpot", "TPOT (ms)", axes[0][1]),
        ("itl", "ITL (ms)", axes[0][2]),
        ("e2el", "E2E latency (ms)", axes[1][0]),
    ]
    for result, name in zip(results, names, strict=True):
        ok = [r for r in records_of(result) if r.success]
        values = {
            "ttft": [r.ttft for r in ok],
            "tpot": [t for r in ok if (t := r.tpot) is not None],
            "itl": [g for r in ok for g in r.itls],
            "e2el": [r.e2el for r in ok],
        }
        for key, _, ax in panels:
            _cdf(ax, values[key], name)
        # Cumulative output tokens over time: the slope is the output throughput.
        ends = sorted((r.send_time + r.e2el, r.output_len) for r in ok)
        if ends:
            times = [e for e, _ in ends]
            axes[1][1].plot(times, np.cumsum([n for _, n in ends]), label=name)
    for key, xlabel, ax in panels:
        lo, hi = ax.dataLim.x0, ax.dataLim.x1
        if ax.lines and lo > 0 and hi / lo > 100:
            ax.set_xscale("log")  # runs orders of magnitude apart stay readable
            xlabel += ", log scale"
        ax.set_xlabel(xlabel)
        ax.set_ylabel("fraction of requests" if key != "itl" else "fraction of gaps")
        ax.set_title(f"{key.upper()} CDF")
        ax.grid(alpha=0.3)
        ax.set_ylim(0, 1.01)
    axes[1][1].set_xlabel("time since start (s)")
    axes[1][1].set_ylabel("output tokens completed")
    axes[1][1].set_title("Output tokens over time")
    axes[1][1].grid(alpha=0.3)

    ax = axes[1][2]
    x = np.arange(len(results))
    width = 0.4
    req_tput = [float(r.get("request_throughput") or 0.0) for r in results]
    out_tput = [float(r.get("output_throughput") or 0.0) for r in results]
    ax.bar(x - width / 2, req_tput, width, label="requests/s", color="tab:blue")
    ax.set_ylabel("requests/s")
    ax2 = ax.twinx()
    ax2.bar(x + width / 2, out_tput, width, label="output tok/s", color="tab:orange")
    ax2.set_ylabel("output tokens/s")
    ax.set_xticks(x, names, rotation=15, ha="right", fontsize=8)
    ax.set_title("Throughput (blue: req/s, orange: output tok/s)")
    for i, r in enumerate(results):
        failed = int(r.get("failed") or 0)
        if failed:
            ax.annotate(f"{failed} failed", (i, 0), ha="center", va="bottom", color="red", fontsize=8)
    for ax in (axes[0][0], axes[1][1]):
        ax.legend(fontsize=8)
    fig.tight_layout()
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=100)
    plt.close(fig)
    return output
