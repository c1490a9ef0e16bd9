"""What one simulation run recorded: the per-step log the event loop appends to,
and ``SimResult``, the raw per-request and per-step arrays assembled from it
(``simulator.compute_metrics`` summarises them)."""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from iterserve.core.request import Request
from iterserve.core.stats import SchedulerStats
from iterserve.sim.stability import StabilityCheck


@dataclass
class SimResult:
    """Raw records of one run; ``metrics`` summarises them."""

    label: str
    # Per request (arrays over accepted requests, in arrival order).
    arrival: np.ndarray
    first_scheduled: np.ndarray
    first_token: np.ndarray
    finished: np.ndarray
    prompt_len: np.ndarray
    output_len: np.ndarray  # tokens actually generated
    num_preemptions: np.ndarray
    itl: np.ndarray  # every inter-token latency, seconds
    # Per step (at schedule time; dt = the step's simulated duration).
    step_time: np.ndarray
    step_dt: np.ndarray
    step_running: np.ndarray
    step_waiting: np.ndarray
    step_batch: np.ndarray
    step_tokens: np.ndarray
    step_kv_usage: np.ndarray
    num_rejected: int = 0
    num_preemptions_total: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    wall_time_s: float = 0.0
    config: dict = field(default_factory=dict)
    stability: StabilityCheck | None = None
    metrics: dict = field(default_factory=dict)
    # A cluster run's per-replica loads (sim/cluster.py); empty for one engine.
    replicas: list[dict] = field(default_factory=list)

    @property
    def num_steps(self) -> int:
        return len(self.step_time)


class StepLog:
    """Per-step records (at schedule time) and inter-token latencies, which the
    event loop appends to directly: compact arrays, no object per step or token."""

    __slots__ = ("batch", "dt", "itl_cnt", "itl_val", "kv", "running", "t", "tokens", "waiting")

    def __init__(self) -> None:
        self.t, self.dt, self.kv = array("d"), array("d"), array("d")
        self.running, self.waiting = array("l"), array("l")
        self.batch, self.tokens = array("l"), array("l")
        # Inter-token latencies as (value, count) pairs: every request that also got a
        # token in the previous step shares one ITL, counted once.
        self.itl_val, self.itl_cnt = array("d"), array("q")

    def record_step(self, now: float, dt: float, stats: SchedulerStats) -> None:
        """A step scheduled at ``now`` that took ``dt``, with the scheduler's gauges."""
        self.t.append(now)
        self.dt.append(dt)
        self.running.append(stats.num_running)
        self.waiting.append(stats.num_waiting)
        self.batch.append(stats.num_scheduled_reqs)
        self.tokens.append(stats.num_scheduled_tokens)
        self.kv.append(stats.kv_cache_usage)


def _floats(a: array) -> np.ndarray:
    return np.frombuffer(a, dtype=np.float64) if len(a) else np.zeros(0)


def build_result(
    label: str,
    reqs: Sequence[Request],
    log: StepLog,
    *,
    num_rejected: int,
    num_preemptions_total: int,
    prefix_cache_queries: int,
    prefix_cache_hits: int,
    wall_time_s: float,
    config: dict,
) -> SimResult:
    """The run's arrays: per accepted request (arrival order) and per step."""
    nan = math.nan

    def col(attr: str) -> np.ndarray:
        return np.array(
            [nan if (v := getattr(r, attr)) is None else v for r in reqs], dtype=np.float64
        )

    itl = (np.repeat(_floats(log.itl_val), np.frombuffer(log.itl_cnt, dtype=np.int64))
           if len(log.itl_val) else np.zeros(0))
    return SimResult(
        label=label,
        arrival=np.array([r.arrival_time for r in reqs], dtype=np.float64),
        first_scheduled=col("first_scheduled_time"),
        first_token=col("first_token_time"),
        finished=col("finished_time"),
        prompt_len=np.array([r.num_prompt_tokens for r in reqs], dtype=np.int64),
        output_len=np.array([r.num_output_tokens for r in reqs], dtype=np.int64),
        num_preemptions=np.array([r.num_preemptions for r in reqs], dtype=np.int64),
        itl=itl,
        step_time=_floats(log.t),
        step_dt=_floats(log.dt),
        step_running=np.array(log.running, dtype=np.int64),
        step_waiting=np.array(log.waiting, dtype=np.int64),
        step_batch=np.array(log.batch, dtype=np.int64),
        step_tokens=np.array(log.tokens, dtype=np.int64),
        step_kv_usage=_floats(log.kv),
        num_rejected=num_rejected,
        num_preemptions_total=num_preemptions_total,
        prefix_cache_queries=prefix_cache_queries,
        prefix_cache_hits=prefix_cache_hits,
        wall_time_s=wall_time_s,
        config=config,
    )
