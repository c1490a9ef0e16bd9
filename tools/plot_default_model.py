"""The default model's loss curve (docs/default-model-loss.png) from the training logs.

    python tools/plot_default_model.py [--out-dir build/default_model] [--png PATH]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def smooth(xs: list[float], k: int = 20) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc = x if i == 0 else (1 - 1 / k) * acc + x / k
        out.append(acc)
    return out


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out-dir", type=Path, default=Path("build/default_model"))
    ap.add_argument("--png", type=Path, default=Path("docs/default-model-loss.png"))
    args = ap.parse_args()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for name, color in (("main", "tab:blue"), ("draft", "tab:orange")):
        log = args.out_dir / name / "train_log.jsonl"
        if not log.is_file():
            continue
        recs = load(log)
        # A second stage (--init-from) continues from the first stage's tokens.
        info = args.out_dir / name / "export" / "training.json"
        first = json.loads(info.read_text()).get("init_from", {}) if info.is_file() else {}
        offset = first.get("tokens_seen", 0)
        if offset:
            ax.axvline(offset / 1e6, color=color, ls=":", alpha=0.6,
                       label=f"{name}: second stage starts (copy rows)")
        tokens = [(offset + r["tokens"]) / 1e6 for r in recs]
        ax.plot(tokens, smooth([r["loss"] for r in recs]), color=color,
                label=f"{name}: training loss (smoothed)")
        val = [((offset + r["tokens"]) / 1e6, r["val_loss"]) for r in recs if "val_loss" in r]
        if val:
            ax.plot(*zip(*val, strict=True), "o", ms=3, color=color, alpha=0.6,
                    label=f"{name}: loss on 8 held-back rows")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("cross-entropy (nats per token)")
    ax.set_ylim(bottom=max(0.0, math.floor(ax.get_ylim()[0])), top=5.5)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("iterserve default model: training on Python's docs and stdlib")
    fig.tight_layout()
    args.png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.png)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
