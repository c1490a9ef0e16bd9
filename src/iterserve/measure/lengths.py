"""Length distributions for prompts and outputs (integer lengths >= 1).

``fixed:N``, ``uniform:LO:HI``, ``lognormal:MEAN:SIGMA[:MAX]`` (heavy tailed),
``pareto:MIN:ALPHA[:MAX]``, or ``trace`` (the trace's own rows, which keeps the
joint prompt/output distribution). ``uniform_around`` is ``vllm bench serve``'s
random dataset range, ``[L(1-r), L(1+r)]``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


class LengthDist:
    """Integer lengths >= 1."""

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        raise NotImplementedError


@dataclass(slots=True)
class Fixed(LengthDist):
    n: int

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.full(n, self.n, dtype=np.int64)


@dataclass(slots=True)
class Uniform(LengthDist):
    lo: int
    hi: int

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.integers(self.lo, self.hi + 1, size=n)


@dataclass(slots=True)
class LogNormal(LengthDist):
    """Heavy tailed with the given mean; sigma sets the tail (1.0 is already long)."""

    mean: float
    sigma: float = 1.0
    max: int = 1 << 30

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        mu = np.log(self.mean) - self.sigma**2 / 2  # so E[X] = mean before clipping
        x = rng.lognormal(mu, self.sigma, size=n)
        return np.clip(np.rint(x), 1, self.max).astype(np.int64)


@dataclass(slots=True)
class Pareto(LengthDist):
    min: int
    alpha: float = 1.5
    max: int = 1 << 30

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        x = self.min * (1.0 + rng.pareto(self.alpha, size=n))
        return np.clip(np.rint(x), 1, self.max).astype(np.int64)


@dataclass(slots=True)
class Empirical(LengthDist):
    values: Sequence[int]

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.choice(np.asarray(self.values, dtype=np.int64), size=n, replace=True)


def parse_length_dist(spec: str | int | LengthDist) -> LengthDist | None:
    """``fixed:N`` | ``uniform:LO:HI`` | ``lognormal:MEAN:SIGMA[:MAX]`` |
    ``pareto:MIN:ALPHA[:MAX]`` | an int | ``trace`` (returns None: use the trace's rows)."""
    if isinstance(spec, LengthDist):
        return spec
    if isinstance(spec, int):
        return Fixed(spec)
    parts = spec.strip().split(":")
    kind, args = parts[0].lower(), parts[1:]
    try:
        if kind == "trace" and not args:
            return None
        if kind.isdigit() and not args:
            return Fixed(int(kind))
        if kind == "fixed" and len(args) == 1:
            return Fixed(int(args[0]))
        if kind == "uniform" and len(args) == 2:
            lo, hi = int(args[0]), int(args[1])
            if not 1 <= lo <= hi:
                raise ValueError
            return Uniform(lo, hi)
        if kind == "lognormal" and len(args) in (2, 3):
            return LogNormal(float(args[0]), float(args[1]), *(int(a) for a in args[2:]))
        if kind == "pareto" and len(args) in (2, 3):
            return Pareto(int(args[0]), float(args[1]), *(int(a) for a in args[2:]))
    except ValueError:
        pass
    raise ValueError(
        f"bad length distribution {spec!r}: use fixed:N, uniform:LO:HI, "
        "lognormal:MEAN:SIGMA[:MAX], pareto:MIN:ALPHA[:MAX] or trace"
    )


def uniform_around(mean: int, ratio: float, low_min: int) -> Uniform:
    """Uniform lengths in ``[mean (1 - ratio), mean (1 + ratio)]``, at least ``low_min``."""
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"random_range_ratio must be in [0, 1), got {ratio}")
    low = max(math.floor(mean * (1 - ratio)), low_min)
    high = max(math.ceil(mean * (1 + ratio)), low)
    return Uniform(low, high)
