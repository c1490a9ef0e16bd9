"""Speculative decoding in the simulator: an acceptance model instead of a proposer and
a target model, the verify step priced by the cost model, and the load at which
speculation stops paying.

The simulated engine runs the production path unchanged: the scheduler's adaptive rule
(``core/spec_decode.py``) decides who gets how many drafts, the engine asks a proposer,
``schedule_drafts`` fits them into the step (lookahead slots), ``update`` keeps the
accepted prefix. Only two things are played:

- :class:`AcceptanceProposer` has a draft for a request with probability
  ``draft_prob`` (an n-gram or suffix proposer finds no match on some steps), of the
  length the scheduler asks for, made of filler ids;
- the ``SimulatedExecutor`` accepts a prefix of each draft by the workload's
  :class:`AcceptanceModel` (draft token ``i`` accepted with probability
  ``per_position[i]`` once tokens ``0 .. i - 1`` were), never past the request's hidden
  output length (the token at that point is its EOS, as without speculation).

Pricing: a verify row of ``1 + k`` tokens is one decode and ``k`` speculative tokens;
each speculative token costs ``decode_seq`` (the runner verifies it as a row of the
decode path, the decoder's few-row step or the paged decode kernel, not as a prefill
chunk, whose per-token cost amortises the step over many tokens) and reads its context. The one-token fast path
(``lone_t0``) no longer applies to a step with drafts, which is often what decides
speculation's worth at batch 1 on a CPU. The proposer's own time is the acceptance
model's ``draft_step_s`` per draft step and ``draft_token_s`` per drafted token (0 by
default: the n-gram and suffix proposers take microseconds; a draft model's are its
step time's fixed and per-sequence parts, e.g. from its roofline).
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from iterserve.config_speculative import SpeculativeConfig
from iterserve.spec_decode.proposer import DraftRequest, Proposer

# Draft ids the acceptance proposer emits (sim.executor's filler token).
SIM_DRAFT_TOKEN_ID = 7


@dataclass(frozen=True, slots=True)
class AcceptanceModel:
    """How often a workload's drafts are right.

    ``per_position[i]``: probability that draft token ``i`` is accepted given tokens
    ``0 .. i - 1`` were (positions past the list repeat its last value).
    ``draft_prob``: probability that the proposer has a draft at all on a step.
    ``draft_step_s`` / ``draft_token_s``: the proposer's own time, per draft step and
    per drafted token (a draft model: its step time's fixed part and per-sequence part;
    0 for the n-gram and suffix proposers, which take microseconds).
    """

    per_position: tuple[float, ...]
    draft_prob: float = 1.0
    seed: int = 0
    draft_step_s: float = 0.0
    draft_token_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.per_position:
            raise ValueError("acceptance model: per_position needs at least one rate")
        for p in (*self.per_position, self.draft_prob):
            if not (isinstance(p, int | float) and 0.0 <= p <= 1.0):
                raise ValueError(f"acceptance model: rates must be in [0, 1], got {p!r}")
        for t in (self.draft_step_s, self.draft_token_s):
            if not (isinstance(t, int | float) and math.isfinite(t) and t >= 0):
                raise ValueError(f"acceptance model: draft costs must be >= 0 s, got {t!r}")

    def draft_time(self, num_steps: int, num_tokens: int) -> float:
        """Seconds the proposer spends on ``num_tokens`` drafts over ``num_steps``
        sequential draft steps (the longest draft's length)."""
        return self.draft_step_s * num_steps + self.draft_token_s * num_tokens

    def rate(self, i: int) -> float:
        pp = self.per_position
        return pp[i] if i < len(pp) else pp[-1]

    def expected_accepted(self, k: int) -> float:
        """Mean accepted drafts out of ``k`` (bonus token not counted)."""
        total, reach = 0.0, 1.0
        for i in range(k):
            reach *= self.rate(i)
            total += reach
        return total

    def mean_acceptance_length(self, k: int) -> float:
        """vLLM's figure: tokens per verified draft, the bonus included."""
        return 1.0 + self.expected_accepted(k)

    # -- constructors -------------------------------------------------------------

    @classmethod
    def constant(cls, rate: float, **kw: Any) -> AcceptanceModel:
        return cls((float(rate),), **kw)

    @classmethod
    def from_mean_length(cls, mean_length: float, k: int, **kw: Any) -> AcceptanceModel:
        """The constant rate whose drafts of ``k`` tokens average ``mean_length``
        tokens per verify step (bonus included): 1 <= mean_length <= 1 + k."""
        if not 1.0 <= mean_length <= 1.0 + k:
            raise ValueError(f"acceptance model: mean_acceptance_length must be in [1, {1 + k}] "
                             f"for {k} draft tokens, got {mean_length}")
        lo, hi = 0.0, 1.0
        for _ in range(60):  # expected_accepted is increasing in the rate
            mid = (lo + hi) / 2
            if 1.0 + cls.constant(mid).expected_accepted(k) < mean_length:
                lo = mid
            else:
                hi = mid
        return cls.constant((lo + hi) / 2, **kw)

    @classmethod
    def from_counts(cls, num_drafts: int, accepted_per_pos: Sequence[int], *,
                    num_steps: int | None = None, **kw: Any) -> AcceptanceModel:
        """From vLLM's counters (``spec_decode_num_drafts``, per-position accepted):
        the conditional rate of each position. ``num_steps``: the decode steps the
        requests had, so ``num_drafts / num_steps`` is how often a draft was found."""
        if num_drafts <= 0 or not accepted_per_pos:
            raise ValueError("acceptance model: counts need num_drafts > 0 and positions")
        rates, prev = [], float(num_drafts)
        for a in accepted_per_pos:
            if prev <= 0:
                break
            rates.append(min(1.0, a / prev))
            prev = float(a)
        if num_steps:
            kw.setdefault("draft_prob", min(1.0, num_drafts / num_steps))
        return cls(tuple(rates), **kw)

    @classmethod
    def parse(cls, value: str | Mapping[str, Any], k: int) -> AcceptanceModel:
        """JSON text or a dict: ``{"rate": 0.7}``, ``{"per_position": [0.8, 0.6]}``,
        ``{"mean_acceptance_length": 2.5}`` (for ``k`` drafts) or vLLM's counters
        ``{"num_drafts": N, "accepted_per_pos": [...]}``; each with an optional
        ``draft_prob`` and ``seed``."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"acceptance model is not valid JSON: {e}") from None
        if not isinstance(value, Mapping):
            raise ValueError("acceptance model must be a JSON object")
        d = dict(value)
        kw = {key: d.pop(key) for key in ("draft_prob", "seed", "draft_step_s", "draft_token_s")
              if key in d}
        if "rate" in d:
            out = cls.constant(d.pop("rate"), **kw)
        elif "per_position" in d:
            out = cls(tuple(float(x) for x in d.pop("per_position")), **kw)
        elif "mean_acceptance_length" in d:
            out = cls.from_mean_length(float(d.pop("mean_acceptance_length")), k, **kw)
        elif "num_drafts" in d:
            out = cls.from_counts(int(d.pop("num_drafts")), list(d.pop("accepted_per_pos", [])),
                                  num_steps=d.pop("num_steps", None), **kw)
        else:
            raise ValueError("acceptance model needs one of rate, per_position, "
                             "mean_acceptance_length, num_drafts")
        if d:
            raise ValueError(f"acceptance model has unknown field(s) {', '.join(sorted(d))}")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"per_position": list(self.per_position), "draft_prob": self.draft_prob,
                "seed": self.seed, "draft_step_s": self.draft_step_s,
                "draft_token_s": self.draft_token_s}


class AcceptanceProposer(Proposer):
    """Drafts of filler ids, present with the model's ``draft_prob``."""

    method = "simulated"

    def __init__(self, config: SpeculativeConfig, acceptance: AcceptanceModel, *,
                 max_model_len: int | None = None) -> None:
        super().__init__(config, max_model_len=max_model_len)
        self.acceptance = acceptance
        self.rng = random.Random(acceptance.seed)

    def propose(self, req_id: str, token_ids: Sequence[int], k: int,
                num_prompt_tokens: int = 0) -> list[int]:
        p = self.acceptance.draft_prob
        if p < 1.0 and self.rng.random() >= p:
            return []
        return [SIM_DRAFT_TOKEN_ID] * k

    def propose_batch(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [self.propose(r.req_id, r.token_ids, r.k) for r in requests]


class AcceptanceSampler:
    """The executor's side: how many of a request's drafts the 'target' accepts."""

    def __init__(self, acceptance: AcceptanceModel) -> None:
        self.acceptance = acceptance
        self.rng = random.Random(acceptance.seed + 1)

    def num_accepted(self, k: int) -> int:
        rate, rnd = self.acceptance.rate, self.rng.random
        for i in range(k):
            if rnd() >= rate(i):
                return i
        return k


# -- where speculation stops paying ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class LoadPoint:
    """One load (request rate, or concurrent requests) with and without speculation."""

    load: float
    tpot_off_ms: float
    tpot_on_ms: float
    throughput_off: float = math.nan  # output tokens / s
    throughput_on: float = math.nan
    mean_acceptance_length: float = math.nan

    @property
    def speedup(self) -> float:
        """TPOT without / with speculation: > 1 while speculation pays."""
        return self.tpot_off_ms / self.tpot_on_ms if self.tpot_on_ms > 0 else math.nan


def break_even(points: Sequence[LoadPoint]) -> float | None:
    """The load where speculation stops paying: the first crossing of speedup 1, linearly
    interpolated between the two loads around it. None if it pays at every load
    given; the first load if it pays at none."""
    pts = sorted(points, key=lambda p: p.load)
    if not pts:
        return None
    if pts[0].speedup <= 1.0:
        return pts[0].load
    for a, b in itertools.pairwise(pts):
        if b.speedup <= 1.0:
            sa, sb = a.speedup - 1.0, b.speedup - 1.0
            if sa == sb:
                return b.load
            return a.load + (b.load - a.load) * sa / (sa - sb)
    return None


def format_points(points: Sequence[LoadPoint], load_name: str = "load") -> str:
    lines = [f"{load_name:>12}{'TPOT off ms':>14}{'TPOT on ms':>13}{'speedup':>9}"
             f"{'tok/s off':>11}{'tok/s on':>10}{'accept len':>12}"]
    for p in points:
        lines.append(f"{p.load:>12.4g}{p.tpot_off_ms:>14.3f}{p.tpot_on_ms:>13.3f}"
                     f"{p.speedup:>9.3f}{p.throughput_off:>11.1f}{p.throughput_on:>10.1f}"
                     f"{p.mean_acceptance_length:>12.2f}")
    be = break_even(points)
    lines.append(f"break-even {load_name}: "
                 + ("speculation pays at every load tried" if be is None else f"{be:.4g}"))
    return "\n".join(lines)


def sweep_loads(
    workload_at: Any,
    loads: Sequence[float],
    scheduler_config: Any,
    cache_config: Any,
    cost_model: Any,
    speculative_config: SpeculativeConfig,
    acceptance: AcceptanceModel,
) -> list[LoadPoint]:
    """Each load (``workload_at(load)`` builds its workload: a request rate, or a number
    of concurrent requests) simulated without and with speculation; TPOT p50 of each."""
    from iterserve.sim.simulator import Simulator, compute_metrics

    points = []
    for load in loads:
        wl = workload_at(load)
        off = compute_metrics(Simulator(scheduler_config, cache_config, cost_model,
                                        record_itl=False).run(wl))
        sim = Simulator(scheduler_config, cache_config, cost_model, record_itl=False,
                        speculative_config=speculative_config, acceptance=acceptance)
        on = compute_metrics(sim.run(wl))
        assert sim.engine is not None and sim.engine.scheduler.spec is not None
        stats = sim.engine.scheduler.spec.stats
        points.append(LoadPoint(
            float(load), off["tpot_ms"]["median"], on["tpot_ms"]["median"],
            off["output_token_throughput"], on["output_token_throughput"],
            stats.mean_acceptance_length if stats.num_drafts else math.nan))
    return points
