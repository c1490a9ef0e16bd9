"""SchedulerStats: what the scheduler reports after each step."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SchedulerStats:
    """A snapshot after each step, read by metrics, logs and the simulator."""

    step_id: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    kv_cache_usage: float = 0.0
    # Cumulative, in tokens.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Cumulative count, and this step's.
    num_preemptions: int = 0
    step_num_preemptions: int = 0
    # This step.
    num_scheduled_tokens: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_scheduled_reqs: int = 0
    # Draft tokens verified this step (speculative decoding; in num_scheduled_tokens).
    num_spec_tokens: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_queries
        return self.prefix_cache_hits / q if q else 0.0
