"""A request as the scheduler sees it: token ids, progress through the KV cache, status, timings."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from iterserve.core.sampling_params import SamplingParams

if TYPE_CHECKING:  # core.outputs imports this module
    from iterserve.core.outputs import TokenLogprobs


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # back in waiting after preemption; its KV is dropped or swapped to host
    # Everything after this line is finished; order matters for ``is_finished``.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One sequence being generated.

    ``num_tokens`` (prompt + output so far) runs ahead of ``num_computed_tokens``
    (tokens whose KV is in the cache); the scheduler's only job for a request is
    to close that gap. A prefill chunk and a decode are the same thing.
    """

    __slots__ = (
        "all_token_ids",
        "arrival_time",
        "block_hashes",
        "block_ids",
        "block_tables",
        "cache_salt",
        "eos_token_id",
        "finished_time",
        "first_scheduled_time",
        "first_token_time",
        "host_block_ids",
        "max_num_tokens",
        "max_tokens",
        "num_cached_blocks",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_external_computed_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "priority",
        "prompt_logprobs",
        "request_id",
        "sampling_params",
        "spec_token_ids",
        "status",
        "stop_reason",
        "stop_token_set",
        "tenant",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float,
        *,
        eos_token_id: int | None = None,
        priority: int = 0,
        tenant: str = "default",
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        # One list for prompt + output so appending a token never copies the prompt.
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens: int = sampling_params.max_tokens or 0  # resolved by the scheduler if 0
        # Prompt + max_tokens: the length at which the request ends (set with max_tokens).
        self.max_num_tokens: int = self.num_prompt_tokens + self.max_tokens
        self.eos_token_id = eos_token_id
        self.priority = priority
        self.tenant = tenant
        # vLLM's cache_salt: mixed into the first block's hash, so requests with
        # different salts never share prefix-cache blocks (core/block_hash.py).
        self.cache_salt = cache_salt
        # Filled by the model runner (engine thread) as prefill chunks run, when
        # sampling_params.prompt_logprobs is set: entry k is prompt token k + 1's.
        self.prompt_logprobs: list[TokenLogprobs] | None = (
            [] if sampling_params.prompt_logprobs is not None else None)
        self.arrival_time = arrival_time
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        # Token ids that may end the request (EOS unless ignore_eos, stop_token_ids),
        # one set so the per-token check is a single lookup.
        self.stop_token_set: frozenset[int] = frozenset(sampling_params.stop_token_ids) | (
            frozenset() if eos_token_id is None or sampling_params.ignore_eos
            else frozenset((eos_token_id,))
        )

        self.num_computed_tokens = 0
        # Leading tokens whose KV arrives from outside the engine (a prefill replica's,
        # in prefill/decode disaggregation): admission allocates their blocks and counts
        # them computed, as vLLM's KV connector's external tokens; 0 once preempted by
        # recompute (the KV is gone).
        self.num_external_computed_tokens = 0
        # Draft tokens to verify in the next step (speculative decoding): set by the
        # engine's proposer between steps, consumed (cleared) by Scheduler.update().
        self.spec_token_ids: list[int] = []
        # Prompt tokens served from the prefix cache at the last admission.
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        # Device block table, owned and mutated only by KVCacheManager.
        self.block_ids: list[int] = []
        # One table per KV cache group (core/kv_groups.py), the first being
        # ``block_ids``; a hybrid model's manager adds the others.
        self.block_tables: list[list[int]] = [self.block_ids]
        # Host block table while swapped out (swap preemption), else empty.
        self.host_block_ids: list[int] = []
        # Hashes of this request's full blocks, extended lazily by KVCacheManager,
        # and how many of its blocks have been offered to the prefix cache so far.
        self.block_hashes: list[bytes] = []
        self.num_cached_blocks = 0

        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    @property
    def is_swapped(self) -> bool:
        return bool(self.host_block_ids)

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_computed_tokens}/{self.num_tokens}, blocks={len(self.block_ids)})"
        )
