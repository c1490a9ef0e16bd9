"""The iteration-level scheduler: the running set is chosen afresh every step.

schedule(now): running requests first (a decode is one token, an unfinished
prefill gets a chunk), then waiting requests in policy order, all under one token
budget (max_num_batched_tokens) and a sequence cap (max_num_seqs). When a running
request cannot get a block, the policy's worst running request is preempted
(recompute or swap) and the allocation is retried.

update(output, now): append sampled tokens, apply stop conditions, free the KV of
finished requests at once so the next schedule() can hand it to waiting requests.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from iterserve.config import CacheConfig, SchedulerConfig
from iterserve.core.kv_cache_manager import KVCacheManager
from iterserve.core.outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    ModelRunnerOutput,
    SchedulerOutput,
)
from iterserve.core.policy import make_policy
from iterserve.core.request import Request, RequestStatus

_RUNNING = RequestStatus.RUNNING


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

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_queries
        return self.prefix_cache_hits / q if q else 0.0


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig) -> None:
        if cache_config.num_gpu_blocks is None:
            raise ValueError("cache_config.num_gpu_blocks must be set before building a Scheduler")
        self.config = scheduler_config
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.kv = KVCacheManager(
            cache_config.num_gpu_blocks,
            cache_config.block_size,
            enable_caching=cache_config.enable_prefix_caching,
            num_host_blocks=(
                cache_config.swap_space if scheduler_config.preemption_mode == "swap" else 0
            ),
        )
        self.policy = make_policy(scheduler_config)
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.long_prefill_token_threshold = (
            scheduler_config.long_prefill_token_threshold or scheduler_config.max_num_batched_tokens
        )
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.use_swap = scheduler_config.preemption_mode == "swap"
        # Tokens one request may occupy: the whole cache, and the model's context.
        self.kv_capacity_tokens = cache_config.num_gpu_blocks * cache_config.block_size

        self.requests: dict[str, Request] = {}  # every unfinished request
        self.running: list[Request] = []
        self.finished_req_ids: list[str] = []  # since the last schedule()
        self.step_id = 0
        self.num_preemptions = 0
        self.stats = SchedulerStats()

    # -- intake ----------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request, or raise ValueError if it could never be served."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        n = request.num_prompt_tokens
        if n == 0:
            raise ValueError("prompt must contain at least one token")
        limit = self.max_model_len
        if n >= limit:
            raise ValueError(
                f"prompt is too long: {n} tokens, the maximum context length is {limit} "
                "(prompt plus at least one generated token)"
            )
        # The last sampled token is never fed back, so a request needs KV for
        # prompt + max_tokens - 1 tokens at most.
        room = min(limit - n, self.kv_capacity_tokens - n + 1)
        if room <= 0:
            raise ValueError(
                f"prompt is too long: {n} tokens do not fit the KV cache "
                f"({self.kv_capacity_tokens} token slots)"
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
                f"does not fit the KV cache ({self.kv_capacity_tokens} token slots)"
            )
        request.max_tokens = max_tokens
        request.max_num_tokens = n + max_tokens
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.policy.add(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.policy)

    # -- the per-step decision ----------------------------------------------------------

    def schedule(self, now: float) -> SchedulerOutput:
        self.step_id += 1
        bs = self.block_size
        budget = self.max_num_batched_tokens
        chunked = self.enable_chunked_prefill
        # Without chunking a prompt is prefilled whole (budget >= max_model_len).
        threshold = self.long_prefill_token_threshold if chunked else budget
        running = self.running

        reqs: list[Request] = []
        nums: list[int] = []
        comps: list[int] = []
        out = SchedulerOutput(self.step_id, reqs, nums, comps, 0)
        preempted_before = self.num_preemptions

        # 1) Running requests, in order: decodes and unfinished prefill chunks. This
        # loop runs once per running request per step: it counts only prefill tokens
        # (decodes and context are sums over the lists afterwards).
        num_prefill = 0
        kv = self.kv
        preempted = False  # in this loop: only then can a later request be a victim
        for req in running[:]:  # a copy: preemption removes victims from ``running``
            if budget <= 0:
                break
            if preempted and req.status is not _RUNNING:
                continue  # preempted earlier in this loop
            computed = req.num_computed_tokens
            num_new = len(req.all_token_ids) - computed
            if num_new != 1 or computed < req.num_prompt_tokens:  # a prefill chunk
                if num_new > threshold:
                    num_new = threshold
                if num_new > budget:
                    num_new = budget
                num_prefill += num_new
            elif computed % bs:
                # A decode inside a block (the common case): the block table holds the
                # computed tokens in whole blocks, so unless ``computed`` ends a block
                # the next token's slot is already there.
                reqs.append(req)
                nums.append(1)
                comps.append(computed)
                budget -= 1
                continue
            # Growing by a block mostly succeeds: only a failed allocation takes the
            # preemption path (which retries it).
            if (
                computed + num_new > len(req.block_ids) * bs
                and kv.allocate_slots(req, num_new) is None
            ):
                before = self.num_preemptions
                fits = self._grow_or_preempt(req, num_new, out)
                if self.num_preemptions != before:
                    preempted = True
                    # Victims left this step too: give their tokens back.
                    budget = self.max_num_batched_tokens - sum(nums)
                    if not fits:
                        continue  # the request itself was the victim
            reqs.append(req)
            nums.append(num_new)
            comps.append(computed)
            budget -= num_new

        # 2) Waiting requests, unless memory was short this step: admitting now would
        # only preempt again next step.
        num_from_running = len(reqs)
        if self.num_preemptions == preempted_before:
            self._admit_waiting(now, budget, threshold, chunked, out)
        else:
            # Victims were removed from this step: count the prefill tokens again.
            num_from_running = num_prefill = 0
        for j in range(num_from_running, len(reqs)):
            req, n, c = reqs[j], nums[j], comps[j]
            if n != 1 or c < req.num_prompt_tokens or c + 1 != len(req.all_token_ids):
                num_prefill += n
        total = sum(nums)
        num_decode = total - num_prefill
        ctx = sum(comps) + total
        out.total_num_scheduled_tokens = num_prefill + num_decode
        out.num_prefill_tokens = num_prefill
        out.num_decode_tokens = num_decode
        out.num_context_tokens = ctx
        if self.finished_req_ids:
            out.finished_req_ids = self.finished_req_ids
            self.finished_req_ids = []

        stats = self.stats
        stats.step_id = self.step_id
        self._refresh_stats()
        stats.step_num_preemptions = self.num_preemptions - preempted_before
        stats.num_scheduled_tokens = num_prefill + num_decode
        stats.num_prefill_tokens = num_prefill
        stats.num_decode_tokens = num_decode
        stats.num_scheduled_reqs = len(reqs)
        return out

    def _refresh_stats(self) -> None:
        """The gauges (running, waiting, KV usage, cumulative counters): after
        schedule(), and again whenever requests finish so an idle engine reads 0."""
        stats = self.stats
        kv = self.kv
        stats.num_running = len(self.running)
        stats.num_waiting = len(self.policy)
        stats.num_swapped = self.kv.num_swapped_requests
        stats.kv_cache_usage = kv.pool.usage
        stats.prefix_cache_queries = kv.prefix_cache_queries
        stats.prefix_cache_hits = kv.prefix_cache_hits
        stats.num_preemptions = self.num_preemptions

    def _grow_or_preempt(self, req: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Allocate blocks for a running request, preempting victims until it fits.

        Returns False when ``req`` itself was the policy's victim (it yields).
        """
        while self.kv.allocate_slots(req, num_new) is None:
            victim = self.policy.select_victim(self.running)
            assert victim is not None  # req itself is running
            self._preempt(victim, out)
            if victim is req:
                return False
        return True

    def _admit_waiting(
        self, now: float, budget: int, threshold: int, chunked: bool, out: SchedulerOutput
    ) -> int:
        policy = self.policy
        running = self.running
        max_num_seqs = self.max_num_seqs
        while budget > 0 and len(running) < max_num_seqs:
            req = policy.peek()
            if req is None:
                break
            if not chunked and len(req.all_token_ids) - req.num_computed_tokens > budget:
                break  # a whole prompt must fit this step's budget
            reserved = self._reserve_for_admission(req, min(threshold, budget), out)
            if reserved is None:
                if self._preempt_to_admit(req, out):
                    budget = self.max_num_batched_tokens - sum(out.num_scheduled_tokens)
                    continue
                break
            num_new, num_cached = reserved
            self._start_running(req, now)
            out.scheduled_requests.append(req)
            out.num_scheduled_tokens.append(num_new)
            out.num_computed_tokens.append(num_cached)
            budget -= num_new
        return budget

    def _reserve_for_admission(
        self, req: Request, max_new: int, out: SchedulerOutput
    ) -> tuple[int, int] | None:
        """KV for a waiting request's first chunk of at most ``max_new`` tokens: swap it
        back in, or reuse its cached prefix and allocate the rest. Returns
        (num_new, num_computed) or None, with nothing changed, when blocks are short."""
        kv = self.kv
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
        num_new = min(len(req.all_token_ids) - num_cached, max_new)
        if kv.allocate_slots(req, num_new, computed_blocks) is None:
            return None
        kv.record_prefix_lookup(len(req.all_token_ids), num_cached)
        req.num_computed_tokens = num_cached
        req.num_cached_tokens = num_cached
        return num_new, num_cached

    def _start_running(self, req: Request, now: float) -> None:
        """Move the policy's head (``req``, just reserved) into the running set."""
        self.policy.pop()
        req.status = _RUNNING
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        self.running.append(req)
        self.policy.on_start(req)

    def _preempt_to_admit(self, req: Request, out: SchedulerOutput) -> bool:
        """Priority-style policies free memory for a better waiting request."""
        if not self.running:
            return False
        victim = self.policy.select_victim(self.running)
        if victim is None or not self.policy.should_preempt_to_admit(req, victim):
            return False
        self._preempt(victim, out)
        return True

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        """Take ``victim`` out of running (and out of this step if already scheduled);
        drop or swap its KV; put it back at the front of waiting."""
        self.running.remove(victim)
        self.policy.on_stop(victim)
        reqs = out.scheduled_requests
        for j in range(len(reqs)):
            if reqs[j] is victim:
                del reqs[j], out.num_scheduled_tokens[j], out.num_computed_tokens[j]
                break
        mapping = self.kv.swap_out(victim) if self.use_swap else None
        if mapping is not None:
            out.blocks_to_swap_out.extend(mapping)
        else:
            self.kv.free(victim)
            victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted_req_ids.append(victim.request_id)
        self.policy.push_front(victim)

    # -- after the step -------------------------------------------------------------------

    def update(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput, now: float
    ) -> EngineCoreOutputs:
        sampled = runner_output.sampled_token_ids
        logprobs = runner_output.logprobs
        kv = self.kv
        caching = kv.enable_caching
        bs = self.block_size
        outputs = EngineCoreOutputs(sampled)
        if logprobs:
            outputs.logprobs = logprobs
        req_ids = outputs.req_ids
        num_finished = 0
        # Requests the executor failed computed nothing: finish them first (error), so
        # the loop below skips them and never advances or caches their blocks.
        if runner_output.failed_req_ids:
            for o in self.finish_requests(
                runner_output.failed_req_ids, RequestStatus.FINISHED_ERROR, now
            ):
                outputs.add_final(o)
        scheduled: Iterable[tuple[Request, int]] = zip(
            scheduler_output.scheduled_requests, scheduler_output.num_scheduled_tokens
        )
        if self.finished_req_ids:
            # Requests finished (aborted, failed) since schedule() are in
            # ``finished_req_ids``; leave them out. Usually there are none, and the
            # per-request loop below needs no status check.
            scheduled = [(r, n) for r, n in scheduled if r.status is _RUNNING]
        for req, n in scheduled:
            computed = req.num_computed_tokens + n
            req.num_computed_tokens = computed
            # A block filled up (``caching`` last: the first test is mostly false).
            if computed // bs > req.num_cached_blocks and caching:
                kv.cache_full_blocks(req)
            rid = req.request_id
            token = sampled.get(rid)
            if token is None:
                continue  # a prefill chunk that did not reach the end
            req.all_token_ids.append(token)  # now ``computed + 1`` tokens long
            if req.first_token_time is None:
                req.first_token_time = now
            req_ids.append(rid)  # its token is ``sampled[rid]``
            # add_request guarantees prompt + max_tokens <= max_model_len, so these two
            # checks cover every stop condition; _check_stop sorts out which.
            if computed + 1 < req.max_num_tokens and token not in req.stop_token_set:
                continue
            num_output = len(req.all_token_ids) - req.num_prompt_tokens
            status = self._check_stop(req, token, num_output)
            if status is not None:
                self._finish(req, status, now)
                self.running.remove(req)  # safe: the loop walks the scheduled lists
                num_finished += 1
                lp = [logprobs[rid]] if logprobs and rid in logprobs else None
                outputs.add_final(
                    EngineCoreOutput(rid, [token], lp, req.finish_reason, req.stop_reason)
                )
        if num_finished:
            self._refresh_stats()
        return outputs

    def _check_stop(self, req: Request, token: int, num_output: int) -> RequestStatus | None:
        params = req.sampling_params
        if num_output >= params.min_tokens:
            if token == req.eos_token_id and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token in req.stop_token_set:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if num_output >= req.max_tokens or len(req.all_token_ids) >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, req: Request, status: RequestStatus, now: float) -> None:
        """Mark finished and free its KV now; the caller removes it from ``running``."""
        was_running = req.status is _RUNNING
        req.status = status
        req.finished_time = now
        self.kv.free(req)
        self.kv.free_host(req)
        if was_running:
            self.policy.on_stop(req)
        del self.requests[req.request_id]
        self.finished_req_ids.append(req.request_id)

    def finish_requests(
        self, request_ids: list[str] | str, status: RequestStatus, now: float = 0.0
    ) -> list[EngineCoreOutput]:
        """Finish requests from outside the step (stop strings, aborts, errors).

        Unknown or already finished ids are ignored. Returns one final output per
        request actually finished.
        """
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        assert status.is_finished
        outputs = []
        removed_running = False
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status is _RUNNING:
                removed_running = True
            else:
                self.policy.remove(req)
            self._finish(req, status, now)
            outputs.append(EngineCoreOutput(rid, [], None, req.finish_reason, req.stop_reason))
        if removed_running:
            self.running = [r for r in self.running if r.status is _RUNNING]
        if outputs:
            self._refresh_stats()
        return outputs

    def abort_requests(self, request_ids: list[str] | str, now: float = 0.0) -> list[EngineCoreOutput]:
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED, now)

    # -- checks ---------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """DESIGN.md invariants 1, 2 and 6, checkable at any point between steps."""
        pool = self.kv.pool
        pool.check_invariants()
        refs = [0] * pool.num_blocks
        for req in self.running:
            for b in req.block_ids:
                refs[b] += 1
        waiting = list(self.policy)
        for req in waiting:
            assert not req.block_ids, f"waiting request holds device blocks: {req}"
        for block in pool.blocks:
            assert block.ref_cnt == refs[block.block_id], (block, refs[block.block_id])
        used = sum(1 for r in refs if r)
        assert used + pool.num_free_blocks == pool.num_blocks
        host_used = sum(len(r.host_block_ids) for r in waiting)
        assert host_used + self.kv.host_pool.num_free_blocks == self.kv.host_pool.num_blocks
        assert self.kv.num_swapped_requests == sum(1 for r in waiting if r.host_block_ids)
        running_ids = {r.request_id for r in self.running}
        waiting_ids = {r.request_id for r in waiting}
        assert len(running_ids) == len(self.running), "duplicate in running"
        assert len(waiting_ids) == len(waiting), "duplicate in waiting"
        assert not running_ids & waiting_ids, running_ids & waiting_ids
        assert running_ids | waiting_ids == set(self.requests), "request lost or stray"
        for req in self.running:
            assert req.status is _RUNNING
        for req in waiting:
            assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert len(self.running) <= self.max_num_seqs
        if not self.requests:
            assert pool.num_free_blocks == pool.num_blocks, "idle engine holds blocks"
