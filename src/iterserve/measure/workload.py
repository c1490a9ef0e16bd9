"""The one workload generator: seeded request specs for ``simulate`` and ``bench serve``.

A workload is an arrival process (``measure.arrivals``: poisson, gamma, all-at-once,
or a trace's times) crossed with prompt and output length distributions
(``measure.lengths``), or a trace's own rows (``measure.traces``). Each part draws
from its own stream of the seed, so the simulator and the benchmark client, which
build their requests differently, agree on arrivals and lengths for one seed.

The output length is known to the simulated model only (it emits EOS at that
step); the scheduler sees ``max_tokens``, which is None (unknown) unless the
workload says.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from iterserve.measure.arrivals import arrival_times
from iterserve.measure.lengths import LengthDist, parse_length_dist
from iterserve.measure.streams import stream
from iterserve.measure.traces import pick, read_trace_rows, row_lengths, trace_arrivals


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
    # The prompt itself, when the workload decides it (multi-turn sessions, whose
    # prompts must extend each other token for token); None: synthesised from the
    # lengths and prefix group. ``prompt_len`` is then its length.
    prompt_token_ids: list[int] | None = None
    # The conversation this request is a turn of (a router's session key).
    session_id: str | None = None


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
                d: dict[str, object] = {
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
                if r.session_id is not None:
                    d["session_id"] = r.session_id
                if r.prompt_token_ids is not None:
                    d["prompt"] = r.prompt_token_ids
                f.write(json.dumps(d) + "\n")


def load_trace(path: str | os.PathLike) -> list[RequestSpec]:
    """A trace (a file, or a shipped trace's name) as specs, sorted by arrival time."""
    rows = read_trace_rows(path)
    reqs = [_spec_from_row(row, f"trace {path} row {i}") for i, row in enumerate(rows)]
    reqs.sort(key=lambda r: r.arrival_time)
    return reqs


def _spec_from_row(row: dict[str, Any], where: str) -> RequestSpec:
    plen, olen = row_lengths(row, where)
    arrival = pick(row, "arrival_time")
    group = row.get("prefix_group")
    max_tokens = row.get("max_tokens")
    prompt = row.get("prompt")
    ids = [int(t) for t in prompt] if isinstance(prompt, list) else None
    if ids is not None and len(ids) != plen:
        raise ValueError(f"{where}: prompt has {len(ids)} token ids, prompt_len says {plen}")
    session = row.get("session_id")
    return RequestSpec(
        arrival_time=0.0 if arrival is None else float(arrival),
        prompt_len=plen,
        output_len=olen,
        priority=int(row.get("priority") or 0),
        tenant=str(row.get("tenant") or "default"),
        prefix_group=None if group in (None, "") else int(group),
        prefix_len=int(row.get("prefix_len") or 0),
        max_tokens=None if max_tokens in (None, "") else int(max_tokens),
        prompt_token_ids=ids,
        session_id=None if session in (None, "") else str(session),
    )


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
    """A seeded workload: arrivals, prompt lengths, output lengths and trace rows each
    from their own stream of ``seed`` (``measure.streams``).

    With ``trace``: ``prompt_len``/``output_len`` of ``"trace"`` take the trace's
    rows (the first ``num_requests`` when arrivals are the trace's, else a seeded
    sample); ``arrival="trace"`` keeps its arrival times (times ``time_scale``,
    or rescaled to ``rate`` when ``rate`` is given with ``time_scale=0``).
    ``reveal_output_len`` tells the scheduler each output length as max_tokens
    (an oracle, for SJF studies).
    """
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
            idx = stream(seed, "trace_rows").integers(0, len(rows), size=n)
            picked = [rows[i] for i in idx]
    elif p_dist is None or o_dist is None or arrival == "trace":
        raise ValueError("'trace' lengths or arrivals need a trace file")

    if arrival == "trace":
        assert picked is not None
        t = trace_arrivals(np.array([r.arrival_time for r in picked]), time_scale, rate)
    else:
        t = arrival_times(n, arrival, rate, burstiness, seed)
    if p_dist is None:
        assert picked is not None
        plens = np.array([r.prompt_len for r in picked])
    else:
        plens = p_dist.sample(stream(seed, "prompt_len"), n)
    if o_dist is None:
        assert picked is not None
        olens = np.array([r.output_len for r in picked])
    else:
        olens = o_dist.sample(stream(seed, "output_len"), n)

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
    label = name or (Path(trace).stem if trace is not None else arrival)
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
