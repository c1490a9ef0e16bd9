"""Request streams for the simulator: an arrival process crossed with length distributions.

Arrivals: ``poisson`` (exponential gaps at ``rate``), ``gamma`` (gaps with shape
``burstiness`` and mean ``1/rate``, as ``vllm bench serve`` draws them: burstiness
< 1 is burstier than Poisson, 1 is Poisson, > 1 is smoother), ``all-at-once``
(everything at t=0), or ``trace`` (the arrival times in a trace file, optionally
rescaled to a target rate).

Lengths: ``fixed:N``, ``uniform:LO:HI``, ``lognormal:MEAN:SIGMA[:MAX]`` (heavy
tailed), ``pareto:MIN:ALPHA[:MAX]``, or ``trace`` (the trace's own rows, which
keeps the joint prompt/output distribution).

Traces: CSV with ``arrived_at,num_prefill_tokens,num_decode_tokens`` (the
Splitwise traces in ../shared/traces) or JSONL with ``arrival_time, prompt_len,
output_len`` and optional ``priority, tenant, prefix_group, prefix_len, max_tokens``.

Everything is drawn from one ``numpy`` generator seeded by ``seed``. The output
length is known to the simulated model only (it emits EOS at that step); the
scheduler sees ``max_tokens``, which is None (unknown) unless the workload says.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from iterserve.core.request import Request
from iterserve.core.sampling_params import SamplingParams


@dataclass(slots=True)
class RequestSpec:
    """One request of a workload, before it becomes a ``Request``."""

    arrival_time: float
    prompt_len: int
    output_len: int
    priority: int = 0
    tenant: str = "default"
    # Requests of one group share their first ``prefix_len`` prompt tokens.
    prefix_group: int | None = None
    prefix_len: int = 0
    # What the scheduler is told (SamplingParams.max_tokens); None: not told.
    max_tokens: int | None = None


@dataclass(slots=True)
class Workload:
    requests: list[RequestSpec]
    name: str = "workload"
    meta: dict[str, object] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def duration(self) -> float:
        return self.requests[-1].arrival_time - self.requests[0].arrival_time if self.requests else 0.0

    @property
    def arrival_rate(self) -> float:
        """Mean arrivals per second (inf when everything arrives at once)."""
        n, d = len(self.requests), self.duration
        if n < 2:
            return 0.0
        return (n - 1) / d if d > 0 else float("inf")

    @property
    def mean_prompt_len(self) -> float:
        return float(np.mean([r.prompt_len for r in self.requests])) if self.requests else 0.0

    @property
    def mean_output_len(self) -> float:
        return float(np.mean([r.output_len for r in self.requests])) if self.requests else 0.0

    @property
    def max_seq_len(self) -> int:
        return max((r.prompt_len + r.output_len for r in self.requests), default=0)

    def describe(self) -> str:
        return (
            f"{self.name}: {len(self)} requests, rate {self.arrival_rate:.3g}/s, "
            f"prompt mean {self.mean_prompt_len:.0f}, output mean {self.mean_output_len:.0f}"
        )

    def to_jsonl(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            for r in self.requests:
                d = {
                    "arrival_time": r.arrival_time,
                    "prompt_len": r.prompt_len,
                    "output_len": r.output_len,
                }
                if r.priority:
                    d["priority"] = r.priority
                if r.tenant != "default":
                    d["tenant"] = r.tenant
                if r.prefix_group is not None:
                    d["prefix_group"], d["prefix_len"] = r.prefix_group, r.prefix_len
                if r.max_tokens is not None:
                    d["max_tokens"] = r.max_tokens
                f.write(json.dumps(d) + "\n")


# ---------------------------------------------------------------------------
# Length distributions
# ---------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------
# Arrival processes
# ---------------------------------------------------------------------------

ARRIVALS = ("poisson", "gamma", "all-at-once", "trace")


def arrival_times(
    rng: np.random.Generator, n: int, kind: str, rate: float = 1.0, burstiness: float = 1.0
) -> np.ndarray:
    kind = kind.lower().replace("_", "-")
    if kind in ("all-at-once", "burst", "offline"):
        return np.zeros(n)
    if not rate > 0:
        raise ValueError(f"rate must be > 0 for {kind} arrivals, got {rate}")
    if kind == "poisson":
        gaps = rng.exponential(1.0 / rate, size=n)
    elif kind == "gamma":
        if not burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {burstiness}")
        gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n)
    else:
        raise ValueError(f"arrival must be one of {', '.join(ARRIVALS)}, got {kind!r}")
    gaps[0] = 0.0  # the first request opens the run
    return np.cumsum(gaps)


# ---------------------------------------------------------------------------
# Traces
# ---------------------------------------------------------------------------


def load_trace(path: str | os.PathLike) -> list[RequestSpec]:
    """CSV (Splitwise/Vidur columns) or JSONL; sorted by arrival time."""
    p = Path(path)
    if p.suffix in (".jsonl", ".json"):
        reqs = [_spec_from_json(json.loads(line)) for line in p.read_text().splitlines() if line.strip()]
    else:
        with open(p, newline="") as f:
            rows = csv.DictReader(f)
            reqs = [
                RequestSpec(
                    arrival_time=float(row.get("arrived_at") or row.get("arrival_time") or 0.0),
                    prompt_len=max(1, int(float(row.get("num_prefill_tokens") or row["prompt_len"]))),
                    output_len=max(1, int(float(row.get("num_decode_tokens") or row["output_len"]))),
                )
                for row in rows
            ]
    reqs.sort(key=lambda r: r.arrival_time)
    return reqs


def _spec_from_json(d: dict) -> RequestSpec:
    def first(*keys: str, default=None):
        for k in keys:
            if k in d and d[k] is not None:
                return d[k]
        if default is None:
            raise ValueError(f"trace row lacks {keys[0]}: {d}")
        return default

    group = d.get("prefix_group")
    return RequestSpec(
        arrival_time=float(first("arrival_time", "arrived_at", "timestamp", default=0.0)),
        prompt_len=max(1, int(first("prompt_len", "num_prefill_tokens", "input_len"))),
        output_len=max(1, int(first("output_len", "num_decode_tokens"))),
        priority=int(d.get("priority", 0)),
        tenant=str(d.get("tenant", "default")),
        prefix_group=None if group is None else int(group),
        prefix_len=int(d.get("prefix_len", 0)),
        max_tokens=None if d.get("max_tokens") is None else int(d["max_tokens"]),
    )


# ---------------------------------------------------------------------------
# Building workloads
# ---------------------------------------------------------------------------


def make_workload(
    num_requests: int | None = None,
    *,
    arrival: str = "poisson",
    rate: float = 1.0,
    burstiness: float = 1.0,
    prompt_len: str | int | LengthDist = "uniform:32:512",
    output_len: str | int | LengthDist = "lognormal:128:1.0:2048",
    trace: str | os.PathLike | None = None,
    time_scale: float = 1.0,
    seed: int = 0,
    reveal_output_len: bool = False,
    name: str | None = None,
) -> Workload:
    """A seeded workload.

    With ``trace``: ``prompt_len``/``output_len`` of ``"trace"`` take the trace's
    rows (the first ``num_requests`` when arrivals are the trace's, else a seeded
    sample); ``arrival="trace"`` keeps its arrival times (times ``time_scale``,
    or rescaled to ``rate`` when ``rate`` is given with ``time_scale=0``).
    ``reveal_output_len`` tells the scheduler each output length as max_tokens
    (an oracle, for SJF studies).
    """
    rng = np.random.default_rng(seed)
    rows = load_trace(trace) if trace is not None else None
    if rows is not None and num_requests is None:
        num_requests = len(rows)
    if not num_requests or num_requests < 1:
        raise ValueError("num_requests must be >= 1 (or give a trace)")
    n = num_requests
    p_dist, o_dist = parse_length_dist(prompt_len), parse_length_dist(output_len)
    arrival = arrival.lower().replace("_", "-")

    picked: list[RequestSpec] | None = None
    if rows is not None and (p_dist is None or o_dist is None or arrival == "trace"):
        if arrival == "trace":
            picked = rows[:n]
            n = len(picked)
        else:
            picked = [rows[i] for i in rng.integers(0, len(rows), size=n)]
    elif p_dist is None or o_dist is None or arrival == "trace":
        raise ValueError("'trace' lengths or arrivals need a trace file")

    if arrival == "trace":
        assert picked is not None
        t = np.array([r.arrival_time for r in picked])
        t -= t[0]
        if time_scale > 0:
            t *= time_scale
        elif t[-1] > 0:
            t *= (n - 1) / rate / t[-1]  # time_scale=0: rescale to the given mean rate
    else:
        t = arrival_times(rng, n, arrival, rate, burstiness)
    plens = np.array([r.prompt_len for r in picked]) if p_dist is None else p_dist.sample(rng, n)
    olens = np.array([r.output_len for r in picked]) if o_dist is None else o_dist.sample(rng, n)

    reqs: list[RequestSpec] = []
    for i in range(n):
        base = picked[i] if picked is not None else None
        o = int(olens[i])
        spec = RequestSpec(float(t[i]), int(plens[i]), o)
        if base is not None:
            spec = replace(
                base, arrival_time=spec.arrival_time, prompt_len=spec.prompt_len, output_len=o
            )
        if reveal_output_len:
            spec.max_tokens = o
        reqs.append(spec)
    label = name or (Path(trace).stem if trace is not None else f"{arrival}")
    return Workload(
        reqs,
        name=label,
        meta={
            "arrival": arrival,
            "rate": rate,
            "burstiness": burstiness,
            "prompt_len": str(prompt_len),
            "output_len": str(output_len),
            "trace": None if trace is None else str(trace),
            "seed": seed,
        },
    )


# ---------------------------------------------------------------------------
# Specs -> engine Requests
# ---------------------------------------------------------------------------

# Token ids: the simulator never looks at them, but the prefix cache hashes them,
# so they must make distinct prompts distinct and shared prefixes equal.
_FILL, _GROUP_FILL, _MARK, _GROUP_MARK = 1, 2, 4, 3


def prompt_token_ids(spec: RequestSpec, index: int, vocab_size: int = 32000) -> list[int]:
    """Cheap synthetic prompt ids: unique per request except a shared group prefix.

    Two tokens encode ``index`` near the start so every full block's hash chain is
    unique; the rest is filler (a list product, far cheaper than random ids).
    """
    v = vocab_size - 8
    n = spec.prompt_len
    head: list[int] = []
    if spec.prefix_group is not None and spec.prefix_len > 0:
        g = spec.prefix_group
        k = min(spec.prefix_len, n)
        head = ([_GROUP_MARK, 8 + g // v % v, 8 + g % v] + [_GROUP_FILL] * k)[:k]
    ids = head + [_MARK, 8 + index // v % v, 8 + index % v] + [_FILL] * n
    return ids[:n] if len(ids) >= n else ids


def to_request(
    spec: RequestSpec,
    index: int,
    eos_token_id: int,
    *,
    request_id: str | None = None,
    sampling_params: SamplingParams | None = None,
    vocab_size: int = 32000,
) -> Request:
    if sampling_params is None:
        sampling_params = SamplingParams(max_tokens=spec.max_tokens, temperature=0.0)
    return Request(
        request_id if request_id is not None else str(index),
        prompt_token_ids(spec, index, vocab_size),
        sampling_params,
        spec.arrival_time,
        eos_token_id=eos_token_id,
        priority=spec.priority,
        tenant=spec.tenant,
    )
