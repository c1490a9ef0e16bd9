"""Per-request latency definitions, as vLLM defines them (docs/metrics.md).

All times are seconds on one clock; "arrival" is when the request reached whoever
measures it (the client's send for ``bench serve``, the engine's arrival for the
server, ``LLM`` and the simulator).

- TTFT: arrival -> first output token.
- TPOT: ``(E2E - TTFT) / (num_output_tokens - 1)``, the mean gap after the first
  token; undefined for a request with one output token (left out of TPOT
  statistics; counts as 0 against a TPOT SLO).
- ITL: the gap between two consecutive outputs of one request that carry tokens,
  one value per output (a chunk of several tokens is one gap, not several).
- E2E: arrival -> the last token (finish).
- Queue time: arrival -> first scheduled.
- Prefill time: first scheduled -> first token; decode time: first token -> last
  token; inference time: first scheduled -> last token (preemptions inside each
  interval count in it, as vLLM counts them).

The column functions take numpy arrays (one element per request, NaN where a time
is missing) so the simulator summarises a million requests without a Python loop;
the scalar ones, used per request, are the same formulas on one element.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np


def tpot_column(ttft: np.ndarray, e2e: np.ndarray, num_output_tokens: np.ndarray) -> np.ndarray:
    """TPOT per request; NaN where fewer than two tokens came out (or a time is NaN)."""
    n = np.asarray(num_output_tokens, dtype=np.float64)
    e2e = np.asarray(e2e, dtype=np.float64)
    ttft = np.asarray(ttft, dtype=np.float64)
    out = np.full(np.shape(n), math.nan)
    multi = n > 1
    out[multi] = (e2e[multi] - ttft[multi]) / (n[multi] - 1)
    return out


def _opt(v: float) -> float | None:
    return None if math.isnan(v) else v


def time_to_first_token(arrival_time: float, first_token_time: float | None) -> float | None:
    return None if first_token_time is None else first_token_time - arrival_time


def e2e_latency(arrival_time: float, finished_time: float | None) -> float | None:
    return None if finished_time is None else finished_time - arrival_time


def queue_time(arrival_time: float, first_scheduled_time: float | None) -> float | None:
    return None if first_scheduled_time is None else first_scheduled_time - arrival_time


def interval(start: float | None, end: float | None) -> float | None:
    """``end - start``; None when either is missing (the phase was not reached)."""
    return None if start is None or end is None else end - start


def time_per_output_token(
    ttft: float | None, e2e: float | None, num_output_tokens: int
) -> float | None:
    """TPOT of one request; None with one output token or before it finished."""
    if ttft is None or e2e is None:
        return None
    return _opt(float(tpot_column(np.array([ttft]), np.array([e2e]),
                                  np.array([num_output_tokens]))[0]))


def inter_token_latencies(output_times: Sequence[float]) -> list[float]:
    """ITLs of one request from the times its token-bearing outputs arrived."""
    return [b - a for a, b in pairwise(output_times)]


@dataclass(slots=True)
class RequestLatencies:
    """Per-request latency columns in seconds (NaN: undefined or not reached)."""

    ttft: np.ndarray
    tpot: np.ndarray
    e2e: np.ndarray
    queue: np.ndarray

    @classmethod
    def from_times(
        cls,
        arrival: np.ndarray,
        first_scheduled: np.ndarray,
        first_token: np.ndarray,
        finished: np.ndarray,
        num_output_tokens: np.ndarray,
    ) -> RequestLatencies:
        """From absolute times (the engine's and the simulator's records)."""
        ttft = np.asarray(first_token, dtype=np.float64) - arrival
        e2e = np.asarray(finished, dtype=np.float64) - arrival
        return cls(ttft, tpot_column(ttft, e2e, num_output_tokens), e2e,
                   np.asarray(first_scheduled, dtype=np.float64) - arrival)

    @classmethod
    def from_durations(
        cls,
        ttft: Sequence[float],
        e2e: Sequence[float],
        num_output_tokens: Sequence[int],
        queue: Sequence[float] | None = None,
    ) -> RequestLatencies:
        """From durations already measured (the benchmark client's records)."""
        t = np.asarray(ttft, dtype=np.float64)
        e = np.asarray(e2e, dtype=np.float64)
        q = np.full(len(t), math.nan) if queue is None else np.asarray(queue, dtype=np.float64)
        return cls(t, tpot_column(t, e, np.asarray(num_output_tokens)), e, q)

    def select(self, mask: np.ndarray) -> RequestLatencies:
        return RequestLatencies(self.ttft[mask], self.tpot[mask], self.e2e[mask], self.queue[mask])


@dataclass(slots=True)
class RequestMetrics:
    """Per-request timings of one request (engine clock, seconds); ``*_offset`` are
    since ``LLM.generate()`` began. The properties are the definitions above."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    arrival_offset: float = 0.0
    finished_offset: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # The last token's time (finished_time can be later: a stop string, an abort).
    last_token_time: float | None = None
    # Outputs that carried tokens (each ITL is the gap between two of them).
    num_token_outputs: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token (arrival -> first token)."""
        return time_to_first_token(self.arrival_time, self.first_token_time)

    @property
    def queue_time(self) -> float | None:
        """Arrival -> first scheduled."""
        return queue_time(self.arrival_time, self.first_scheduled_time)

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None with a single output token."""
        return time_per_output_token(self.ttft, self.e2e_latency, self.num_output_tokens)

    @property
    def itl_mean(self) -> float | None:
        """Mean gap between this request's token-bearing outputs; None with fewer than two."""
        if self.num_token_outputs < 2:
            return None
        return interval(self.first_token_time, self.last_token_time) / (  # type: ignore[operator]
            self.num_token_outputs - 1)

    @property
    def e2e_latency(self) -> float | None:
        """Arrival -> finished."""
        return e2e_latency(self.arrival_time, self.finished_time)

    @property
    def prefill_time(self) -> float | None:
        """First scheduled -> first token."""
        return interval(self.first_scheduled_time, self.first_token_time)

    @property
    def decode_time(self) -> float | None:
        """First token -> last token."""
        return interval(self.first_token_time, self.last_token_time)

    @property
    def inference_time(self) -> float | None:
        """First scheduled -> last token."""
        return interval(self.first_scheduled_time, self.last_token_time)
