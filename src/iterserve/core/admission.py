"""Admission: the checks a new request passes, and which waiting requests join the
running set this step.

The policy's head is tried first, always. When it cannot start, admission stops
there, as vLLM's does, unless backfill is on: then requests behind it may start if
all of their prompt fits, within bounds that keep the head from being pushed back
without limit:

- only the token budget held the head back (no chunked prefill): a request may pass
  only if the blocks the head needs stay free, so it starts next step as it would have;
- a big prompt (over 1/BIG_PROMPT_SHARE of the cache) waits until all of it fits
  rather than start on one chunk's blocks and grow into a full cache (preempting, or
  being preempted and recomputed); it can be passed ``backfill_max_passes`` times,
  then it starts on a chunk as without backfill;
- its next chunk does not fit: every free block is the head's, nothing passes.

Blocks that running prefills' later chunks will need are held back from new requests.
Candidates are the first few requests behind the head in policy order (a bounded
scan, so a long queue costs nothing extra per step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from iterserve.core.outputs import SchedulerOutput
from iterserve.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from iterserve.core.scheduler import Scheduler

# How many requests behind the head a backfill pass looks at.
BACKFILL_SCAN = 32
# A prompt needing more than 1/BIG_PROMPT_SHARE of the cache starts only when all of
# it fits (with backfill): started on a chunk it would crowd the cache and preempt.
BIG_PROMPT_SHARE = 8


def check_lengths(s: Scheduler, request: Request) -> int:
    """add_request's checks: the prompt and max_tokens fit the context and the KV cache
    (ValueError naming the problem, else). Returns max_tokens, resolved when unset."""
    n = request.num_prompt_tokens
    if n == 0:
        raise ValueError("prompt must contain at least one token")
    limit = s.max_model_len
    if n >= limit:
        raise ValueError(
            f"prompt is too long: {n} tokens, the maximum context length is {limit} "
            "(prompt plus at least one generated token)"
        )
    # The last sampled token is never fed back, so a request needs KV for
    # prompt + max_tokens - 1 tokens at most.
    room = min(limit - n, s.kv_capacity_tokens - n + 1)
    if room <= 0:
        raise ValueError(
            f"prompt is too long: {n} tokens do not fit the KV cache "
            f"({s.kv_capacity_tokens} token slots)"
        )
    max_tokens = request.sampling_params.max_tokens
    if max_tokens is None:
        max_tokens = room
    elif n + max_tokens > limit:
        raise ValueError(
            f"max_tokens is too large: prompt ({n} tokens) + max_tokens ({max_tokens}) "
            f"exceeds the maximum context length {limit}"
        )
    elif max_tokens > room:
        raise ValueError(
            f"max_tokens is too large: prompt ({n} tokens) + max_tokens ({max_tokens}) "
            f"does not fit the KV cache ({s.kv_capacity_tokens} token slots)"
        )
    return max_tokens


def admit_waiting(
    s: Scheduler,
    now: float,
    budget: int,
    step_budget: int,
    threshold: int,
    chunked: bool,
    out: SchedulerOutput,
) -> int:
    """Admit waiting requests in policy order (then backfill); returns the budget left
    of ``step_budget``."""
    policy = s.policy
    running = s.running
    max_num_seqs = s.max_num_seqs
    blocked: Request | None = None  # the head, when it could not start
    budget_only = False  # ... and only for lack of token budget
    backfill_on = s.enable_backfill
    while budget > 0 and len(running) < max_num_seqs:
        req = policy.peek()
        if req is None:
            break
        if not policy.can_admit(req, len(running)):
            break  # the policy's batch cap: nobody else joins either
        # The long-prefill cap applies only when another request could use the budget.
        cap = threshold if (running or len(policy) > 1) else budget
        remaining = len(req.all_token_ids) - _computed_at_admission(req)
        if not chunked and remaining > budget:
            blocked, budget_only = req, True  # a whole prompt must fit this step's budget
            break
        if (
            backfill_on
            and running  # only a running request's blocks can come free
            and s.kv.blocks_to_hold(remaining) > s.kv.num_free_blocks - s.pending_prefill_blocks
            and s.kv.blocks_to_hold(remaining) <= s.kv.num_blocks  # else it never fits whole
            and (s.kv.blocks_to_hold(remaining) - 1) * BIG_PROMPT_SHARE > s.kv.num_blocks
            and not req.host_block_ids
            and (req is not s.backfill_head or s.backfill_passes < s.backfill_max_passes)
        ):
            # With backfill a prompt waits until all of it fits (started on one chunk's
            # blocks it would grow into a full cache and preempt), but only while running
            # requests can free blocks for it, and only until it has been passed
            # backfill_max_passes times: then it starts on a chunk as without backfill.
            blocked = req
            break
        reserved = reserve_for_admission(s, req, min(cap, budget), out)
        if reserved is None:
            if preempt_to_admit(s, req, out):
                budget = step_budget - sum(out.num_scheduled_tokens)
                continue
            # Not even its next chunk fits: every free block is the head's (no backfill).
            break
        num_new, num_cached = reserved
        policy.pop()
        start_running(s, req, now)
        _schedule(out, req, num_new, num_cached)
        s.pending_prefill_blocks += s.kv.blocks_for(len(req.all_token_ids) - num_cached - num_new)
        budget -= num_new
    if blocked is not None and backfill_on and budget > 0 and len(running) < max_num_seqs:
        budget = backfill(s, blocked, budget_only, now, budget, threshold, chunked, out)
    return budget


def backfill(
    s: Scheduler,
    head: Request,
    budget_only: bool,
    now: float,
    budget: int,
    threshold: int,
    chunked: bool,
    out: SchedulerOutput,
) -> int:
    """Start requests behind ``head`` that fit, within the reservation and the pass cap."""
    if s.backfill_head is not head:
        s.backfill_head = head
        s.backfill_passes = 0
    max_passes = s.backfill_max_passes
    if s.backfill_passes >= max_passes:
        return budget
    kv = s.kv
    policy = s.policy
    running = s.running
    # Blocks the head needs for its next chunk: held back from backfill when only the
    # budget stopped it (when blocks stopped it, the pass cap is the bound).
    reserve = 0
    if budget_only:
        reserve = kv.blocks_for(len(head.all_token_ids) - head.num_computed_tokens)
    for req in policy.backfill_candidates(BACKFILL_SCAN):
        if req.host_block_ids:
            continue  # swapped out: it returns through the head, in order
        remaining = len(req.all_token_ids) - _computed_at_admission(req)
        if not chunked and remaining > budget:
            continue
        if not policy.can_admit(req, len(running)):
            break
        want = min(threshold, budget, remaining)
        # Only a request whose whole prompt (and a block to decode into) fits now may
        # pass: one that fits just its first chunk would grow into a full cache and
        # preempt (a prefix-cache hit only lowers the count).
        if kv.num_free_blocks - s.pending_prefill_blocks - kv.blocks_to_hold(remaining) < reserve:
            continue
        reserved = reserve_for_admission(s, req, want, out)
        if reserved is None:
            continue
        num_new, num_cached = reserved
        policy.remove(req)
        start_running(s, req, now)
        _schedule(out, req, num_new, num_cached)
        s.pending_prefill_blocks += s.kv.blocks_for(len(req.all_token_ids) - num_cached - num_new)
        budget -= num_new
        s.backfill_passes += 1
        s.num_backfilled += 1
        if s.backfill_passes >= max_passes or budget <= 0 or len(running) >= s.max_num_seqs:
            break
    return budget


def reserve_for_admission(
    s: Scheduler, req: Request, max_new: int, out: SchedulerOutput
) -> tuple[int, int] | None:
    """KV for a waiting request's first chunk of at most ``max_new`` tokens: swap it
    back in, or reuse its cached prefix (and any external KV) and allocate the rest.
    Returns (num_new, num_computed) or None, with nothing changed, when blocks are short."""
    kv = s.kv
    if req.host_block_ids:
        num_new = min(len(req.all_token_ids) - req.num_computed_tokens, max_new)
        mapping = kv.swap_in(req, num_new)
        if mapping is None:
            return None
        out.blocks_to_swap_in.extend(mapping)
        return num_new, req.num_computed_tokens
    if req.prompt_logprobs is None:
        computed_blocks, num_cached = kv.get_computed_blocks(req)
    else:  # every prompt position must run through the model for its logprobs
        computed_blocks, num_cached = [], 0
    # KV that arrived with the request (beyond the cached prefix) is computed too; its
    # blocks are allocated here, with the first chunk's.
    num_external = max(req.num_external_computed_tokens - num_cached, 0)
    num_computed = num_cached + num_external
    num_new = min(len(req.all_token_ids) - num_computed, max_new)
    if kv.allocate_slots(req, num_external + num_new, computed_blocks) is None:
        return None
    kv.record_prefix_lookup(len(req.all_token_ids), num_cached)
    req.num_computed_tokens = num_computed
    req.num_cached_tokens = num_cached
    return num_new, num_computed


def _computed_at_admission(req: Request) -> int:
    """Tokens a waiting request will not compute: its KV so far (swapped, or
    arriving from outside the engine)."""
    return max(req.num_computed_tokens, req.num_external_computed_tokens)


def start_running(s: Scheduler, req: Request, now: float) -> None:
    """Move ``req`` (reserved, already out of the waiting queue) into the running set."""
    req.status = RequestStatus.RUNNING
    if req.first_scheduled_time is None:
        req.first_scheduled_time = now
    s.running.append(req)
    s.policy.on_start(req)
    if req is s.backfill_head:
        s.backfill_head = None


def _schedule(out: SchedulerOutput, req: Request, num_new: int, num_cached: int) -> None:
    out.scheduled_requests.append(req)
    out.num_scheduled_tokens.append(num_new)
    out.num_computed_tokens.append(num_cached)


def preempt_to_admit(s: Scheduler, req: Request, out: SchedulerOutput) -> bool:
    """Priority-style policies free memory for a better waiting request."""
    if not s.running:
        return False
    victim = s.policy.select_victim(s.running)
    if victim is None or not s.policy.should_preempt_to_admit(req, victim):
        return False
    s.preempt(victim, out)
    return True
