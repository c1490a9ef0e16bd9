"""Write the shipped long-context trace ``summarization_long.csv`` (deterministic).

Summarization traffic: long prompts, short outputs. Lengths are drawn from log-normal
distributions whose means are the published CNN/DailyMail figures (See et al., 2017,
"Get To The Point": articles 781 tokens, summaries 56 tokens on average), the prompt
lengths scaled by ``--prompt-scale`` (1.6) so that they span the 2,048-token context of
the benchmark models (mean ~1,250 tokens, clipped to [256, 1,984]); outputs clipped to
[8, 200]. The spreads (log-space sigma 0.45 for prompts, 0.35 for outputs) are this
script's choice: the paper gives means only. Arrivals are Poisson at 1 request/s;
replays rescale them to the rate they need.

    python benchmarks/tools/make_summarization_trace.py   # rewrites the shipped file
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parents[2] / "src/iterserve/data/traces/summarization_long.csv"
ARTICLE_MEAN, SUMMARY_MEAN = 781.0, 56.0  # CNN/DailyMail, See et al. (2017), Table 1


def lognormal(rng: np.random.Generator, mean: float, sigma: float, n: int) -> np.ndarray:
    """Log-normal draws with the given arithmetic mean and log-space sigma."""
    mu = np.log(mean) - sigma**2 / 2
    return rng.lognormal(mu, sigma, n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=2000)
    ap.add_argument("--prompt-scale", type=float, default=1.6)
    ap.add_argument("--seed", type=int, default=2017)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    n = args.num_requests
    prompts = np.clip(lognormal(rng, ARTICLE_MEAN * args.prompt_scale, 0.45, n), 256, 1984)
    outputs = np.clip(lognormal(rng, SUMMARY_MEAN, 0.35, n), 8, 200)
    arrivals = np.concatenate([[0.0], np.cumsum(rng.exponential(1.0, n - 1))])
    with open(args.out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["arrived_at", "num_prefill_tokens", "num_decode_tokens"])
        for t, p, o in zip(arrivals, prompts.round().astype(int), outputs.round().astype(int)):
            w.writerow([f"{t:.4f}", int(p), int(o)])
    print(f"wrote {args.out}: {n} requests, mean prompt {prompts.mean():.0f}, "
          f"mean output {outputs.mean():.0f}")


if __name__ == "__main__":
    main()
