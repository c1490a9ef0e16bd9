"""Shared helpers for scheduler tests: a fake model that samples one token per finished prefill."""

from __future__ import annotations

from iterserve.config import CacheConfig, SchedulerConfig
from iterserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from iterserve.core.request import Request
from iterserve.core.sampling_params import SamplingParams
from iterserve.core.scheduler import Scheduler

EOS = 0


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    *,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    swap_space: int = 0,
    kv_cache_groups=None,
    **kwargs,
) -> Scheduler:
    cache_keys = {"enable_prefix_caching"}
    cache_kw = {k: v for k, v in kwargs.items() if k in cache_keys}
    sched_kw = {k: v for k, v in kwargs.items() if k not in cache_keys}
    cache = CacheConfig(
        block_size=block_size, num_gpu_blocks=num_blocks, swap_space=swap_space, **cache_kw
    )
    sched = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        **sched_kw,
    )
    return Scheduler(sched, cache, kv_cache_groups=kv_cache_groups)


def make_request(
    rid: str,
    prompt: list[int] | int,
    max_tokens: int = 8,
    *,
    arrival: float = 0.0,
    priority: int = 0,
    tenant: str = "default",
    ignore_eos: bool = True,
    cache_salt: str | None = None,
    **params,
) -> Request:
    if isinstance(prompt, int):
        prompt = [(hash((rid, i)) % 1000) + 1 for i in range(prompt)]
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, **params)
    return Request(
        rid, prompt, sp, arrival, eos_token_id=EOS, priority=priority, tenant=tenant,
        cache_salt=cache_salt,
    )


def fake_model_output(out: SchedulerOutput, token: int = 7) -> ModelRunnerOutput:
    """One sampled token for every request whose scheduled tokens reach its end."""
    sampled = {}
    for req, n, c in zip(out.scheduled_requests, out.num_scheduled_tokens, out.num_computed_tokens):
        if c + n == req.num_tokens:
            sampled[req.request_id] = token
    return ModelRunnerOutput(sampled)


def run_to_completion(sched: Scheduler, now: float = 0.0, max_steps: int = 100_000):
    outputs = []
    steps = []
    while sched.has_unfinished_requests():
        out = sched.schedule(now)
        steps.append(out)
        outputs.extend(sched.update(out, fake_model_output(out), now))
        sched.check_invariants()
        now += 1.0
        assert len(steps) < max_steps, "scheduler made no progress"
    return outputs, steps
