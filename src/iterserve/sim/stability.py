"""Little's-law stability check: offered load against the cost model's capacity,
computed before a simulation runs."""

from __future__ import annotations

import math
from dataclasses import dataclass

from iterserve.config import CacheConfig, SchedulerConfig
from iterserve.sim.cost_model import CostModel
from iterserve.sim.long_context import chunk_excess_pairs
from iterserve.sim.workload import Workload


@dataclass(slots=True)
class StabilityCheck:
    """Offered load against the capacity the cost model predicts, before running."""

    arrival_rate: float  # requests/s
    offered_tokens_per_s: float  # arrival rate x mean output length
    capacity_tokens_per_s: float  # output tokens/s at the largest feasible batch
    capacity_requests_per_s: float
    batch_size: float  # the largest steady-state batch
    batch_limit: str  # what bounds it: kv cache | max_num_seqs | token budget
    step_time_s: float  # predicted step time at that batch

    @property
    def utilization(self) -> float:
        if self.capacity_tokens_per_s <= 0:
            return math.inf
        return self.offered_tokens_per_s / self.capacity_tokens_per_s

    @property
    def is_offline(self) -> bool:
        return math.isinf(self.arrival_rate)

    @property
    def is_oversubscribed(self) -> bool:
        return not self.is_offline and self.utilization >= 1.0

    def message(self) -> str:
        head = (
            f"capacity {self.capacity_tokens_per_s:,.0f} output tok/s "
            f"({self.capacity_requests_per_s:,.2f} req/s) at batch {self.batch_size:.0f} "
            f"(bounded by {self.batch_limit}; step {self.step_time_s * 1e3:.2f} ms)"
        )
        if self.is_offline:
            return f"Stability check: all requests arrive at once (offline); {head}."
        line = (
            f"Stability check (Little's law): offered {self.offered_tokens_per_s:,.0f} output tok/s "
            f"({self.arrival_rate:,.2f} req/s) vs {head}: utilization {self.utilization:.2f}."
        )
        if self.is_oversubscribed:
            line += (
                "\nWARNING: oversubscribed: arrivals outpace the best service rate, so the queue "
                "grows without bound; no scheduling policy repairs this (lower the rate or add capacity)."
            )
        return line


def stability_check(
    workload: Workload,
    cost_model: CostModel,
    scheduler_config: SchedulerConfig,
    cache_config: CacheConfig,
) -> StabilityCheck:
    """Capacity from the cost model at the largest batch the KV budget, sequence cap and
    token budget allow; offered load from the workload's rate and mean lengths.

    In steady state with B requests decoding and mean lengths P (prompt), D (output),
    B/D requests finish per step, so each step also prefills B*P/D tokens and holds
    B*(P + D/2) tokens of context on average. Service rate: B/D requests per step time.
    A calibrated cost model's prefill attention adds each prompt's causal query x key
    pairs (the mean of p(p+1)/2 over the workload's prompts, not of the mean prompt:
    long prompts weigh quadratically). Its long-context terms add, per knot, the decode
    tokens each request holds past it (at its prompt plus half the mean output) and its
    prompt's prefill pairs past it, averaged the same way; idle decode threads, which a
    batch this large rarely leaves, are not counted.
    """
    p = max(workload.mean_prompt_len, 1.0)
    d = max(workload.mean_output_len, 1.0)
    num_blocks = cache_config.num_gpu_blocks or 0
    limits = {
        "kv cache": num_blocks * cache_config.block_size / (p + d / 2),
        "max_num_seqs": float(scheduler_config.max_num_seqs),
        "token budget": scheduler_config.max_num_batched_tokens / (1.0 + p / d),
    }
    limit = min(limits, key=limits.get)  # type: ignore[arg-type]
    b = max(limits[limit], 1e-9)
    pairs = 0.0
    if cost_model.prefill_attn and workload.requests:
        pairs = sum(s.prompt_len * (s.prompt_len + 1) / 2 for s in workload.requests) / len(
            workload.requests)
    long: list[float] = []
    if cost_model.has_long_context and workload.requests:
        knots = cost_model.context_knots
        n = len(workload.requests)
        dec = [sum(max(0.0, s.prompt_len + d / 2 - k) for s in workload.requests) / n
               for k in knots]
        pre = [sum(chunk_excess_pairs(s.prompt_len, 0, k) for s in workload.requests) / n
               for k in knots]
        long = [0.0, *(b * x for x in dec), *(b / d * x for x in pre)]
    tau = cost_model.time_for(
        num_prefill_tokens=b * p / d, num_decode_seqs=b, num_context_tokens=b * (p + d / 2),
        num_prefill_attn_pairs=b / d * pairs, long_context=long,
    )
    cap_tok = b / tau
    rate = workload.arrival_rate
    return StabilityCheck(
        arrival_rate=rate,
        offered_tokens_per_s=rate * d,
        capacity_tokens_per_s=cap_tok,
        capacity_requests_per_s=cap_tok / d,
        batch_size=b,
        batch_limit=limit,
        step_time_s=tau,
    )
