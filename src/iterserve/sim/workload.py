"""Workload specs -> engine ``Request``s for the simulator.

The workloads themselves (arrivals, lengths, traces) come from the one generator in
:mod:`iterserve.measure.workload`, shared with ``bench serve``; its names are
re-exported here for the simulator's callers.
"""

from __future__ import annotations

from iterserve.core.request import Request
from iterserve.core.sampling_params import SamplingParams
from iterserve.measure.arrivals import ARRIVALS, arrival_times
from iterserve.measure.lengths import (
    Empirical,
    Fixed,
    LengthDist,
    LogNormal,
    Pareto,
    Uniform,
    parse_length_dist,
)
from iterserve.measure.workload import RequestSpec, Workload, load_trace, make_workload
from iterserve.measure.workload_multi_turn import MultiTurnConfig, make_multi_turn_workload

__all__ = [
    "ARRIVALS",
    "Empirical",
    "Fixed",
    "LengthDist",
    "LogNormal",
    "MultiTurnConfig",
    "Pareto",
    "RequestSpec",
    "Uniform",
    "Workload",
    "arrival_times",
    "load_trace",
    "make_multi_turn_workload",
    "make_workload",
    "parse_length_dist",
    "prompt_token_ids",
    "to_request",
]

# Token ids: the simulator never looks at them, but the prefix cache hashes them,
# so they must make distinct prompts distinct and shared prefixes equal.
_FILL, _GROUP_FILL, _MARK, _GROUP_MARK = 1, 2, 4, 3


def prompt_token_ids(spec: RequestSpec, index: int, vocab_size: int = 32000) -> list[int]:
    """Cheap synthetic prompt ids: unique per request except a shared group prefix.

    Two tokens encode ``index`` near the start so every full block's hash chain is
    unique; the rest is filler (a list product, far cheaper than random ids). A spec
    that carries its prompt (multi-turn sessions) keeps it.
    """
    if spec.prompt_token_ids is not None:
        return spec.prompt_token_ids
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
