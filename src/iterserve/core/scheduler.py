"""The iteration-level scheduler: the running set is chosen afresh every step.

schedule(now): running requests first (a decode is one token, an unfinished
prefill gets a chunk), then waiting requests in policy order, all under one token
budget (max_num_batched_tokens) and a sequence cap (max_num_seqs). When a running
request cannot get a block, the policy's worst running request is preempted
(recompute or swap) and the allocation is retried. Admission (policy order, then
backfill) lives in admission.py.

update(output, now): append sampled tokens, apply stop conditions, free the KV of
finished requests at once so the next schedule() can hand it to waiting requests.

Speculative decoding (a SpeculativeConfig given): a decoding request whose
``spec_token_ids`` the engine set gets ``1 + k`` tokens, its drafts fitted into the
budget and free blocks that nothing else took this step (spec_step.py); update()
keeps the accepted prefix and gives the rejected tail's blocks back.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from iterserve.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from iterserve.core.admission import (
    admit_waiting,
    check_lengths,
    reserve_for_admission,
    start_running,
)
from iterserve.core.hybrid_kv_cache_manager import HybridKVCacheManager
from iterserve.core.invariants import check_invariants
from iterserve.core.kv_cache_manager import KVCacheManager
from iterserve.core.kv_groups import KVCacheGroupSpec
from iterserve.core.outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    ModelRunnerOutput,
    SchedulerOutput,
)
from iterserve.core.policy import make_policy
from iterserve.core.request import Request, RequestStatus
from iterserve.core.spec_decode import SpecDecodeController
from iterserve.core.spec_step import schedule_drafts, update_spec_request
from iterserve.core.stats import SchedulerStats

_RUNNING = RequestStatus.RUNNING


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        speculative_config: SpeculativeConfig | None = None,
        kv_cache_groups: Sequence[KVCacheGroupSpec] | None = None,
    ) -> None:
        """``kv_cache_groups``: the model's KV cache groups (core/kv_groups.py); None or
        one group: every layer attends globally."""
        if cache_config.num_gpu_blocks is None:
            raise ValueError("cache_config.num_gpu_blocks must be set before building a Scheduler")
        if scheduler_config.max_model_len is None:
            raise ValueError("scheduler_config.max_model_len must be set before building a Scheduler")
        self.config = scheduler_config
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.kv: KVCacheManager
        num_host_blocks = (
            cache_config.swap_space if scheduler_config.preemption_mode == "swap" else 0
        )
        if kv_cache_groups is not None and len(kv_cache_groups) > 1:
            # A hybrid model (sliding-window and global layers): a table per group.
            self.kv = HybridKVCacheManager(
                kv_cache_groups,
                cache_config.num_gpu_blocks,
                cache_config.block_size,
                enable_caching=cache_config.enable_prefix_caching,
                num_host_blocks=num_host_blocks,
                hash_algo=cache_config.prefix_caching_hash_algo,
            )
        else:
            self.kv = KVCacheManager(
                cache_config.num_gpu_blocks,
                cache_config.block_size,
                enable_caching=cache_config.enable_prefix_caching,
                num_host_blocks=num_host_blocks,
                hash_algo=cache_config.prefix_caching_hash_algo,
            )
        self.policy = make_policy(scheduler_config, cache_config.block_size)
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.long_prefill_token_threshold = (
            scheduler_config.long_prefill_token_threshold or scheduler_config.max_num_batched_tokens
        )
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.use_swap = scheduler_config.preemption_mode == "swap"
        # Tokens one request may occupy: the whole cache, and the model's context.
        self.kv_capacity_tokens = self.kv.capacity_tokens(scheduler_config.max_num_batched_tokens)

        # The slo policy always backfills: a request that cannot start must not hold
        # back one that could still meet its target.
        self.enable_backfill = (
            scheduler_config.enable_backfill or scheduler_config.scheduling_policy == "slo"
        )
        self.backfill_max_passes = scheduler_config.backfill_max_passes
        # The head backfill is passing, and how many requests passed it so far.
        self.backfill_head: Request | None = None
        self.backfill_passes = 0
        self.num_backfilled = 0
        # Blocks that running prefills' later chunks will need (set each step).
        self.pending_prefill_blocks = 0
        self.pending_prefill_tokens = 0
        # When the step in flight was scheduled: update() reports its duration.
        self.schedule_time = 0.0

        self.requests: dict[str, Request] = {}  # every unfinished request
        self.running: list[Request] = []
        self.finished_req_ids: list[str] = []  # since the last schedule()
        self.step_id = 0
        self.num_preemptions = 0
        self.stats = SchedulerStats()
        # Speculative decoding's per-request K and counters; None when it is off.
        self.spec: SpecDecodeController | None = (
            SpecDecodeController(speculative_config, scheduler_config.step_time_coefficients)
            if speculative_config is not None else None
        )

    # -- intake ----------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request, or raise ValueError if it could never be served."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        max_tokens = check_lengths(self, request)
        n = request.num_prompt_tokens
        request.max_tokens = max_tokens
        request.max_num_tokens = n + max_tokens
        request.status = RequestStatus.WAITING
        self.policy.check_admission(request)
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
        self.schedule_time = now
        bs = self.block_size
        running = self.running
        policy = self.policy
        budget = policy.begin_step(
            now, len(running), self.max_num_batched_tokens, self.pending_prefill_tokens
        )
        step_budget = budget
        chunked = self.enable_chunked_prefill
        # Without chunking a prompt is prefilled whole (budget >= max_model_len). The
        # long-prefill cap applies only when another request could use the budget:
        # a lone request gets all of it.
        threshold = self.long_prefill_token_threshold if chunked else budget
        if threshold < budget and len(running) <= 1 and not (
            len(policy) and len(running) < self.max_num_seqs and self.kv.num_free_blocks
        ):
            threshold = budget

        reqs: list[Request] = []
        nums: list[int] = []
        comps: list[int] = []
        out = SchedulerOutput(self.step_id, reqs, nums, comps, 0)
        preempted_before = self.num_preemptions

        # 1) Running requests, in order: decodes and unfinished prefill chunks. This
        # loop runs once per running request per step: it counts only prefill tokens
        # (decodes and context are sums over the lists afterwards).
        num_prefill = 0
        pending_blocks = pending_tokens = 0
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
                # Blocks its later chunks will need: admission leaves them free.
                rest = len(req.all_token_ids) - computed - num_new
                pending_blocks += kv.blocks_for(rest)
                pending_tokens += rest
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
                    budget = step_budget - sum(nums)
                    if not fits:
                        continue  # the request itself was the victim
            reqs.append(req)
            nums.append(num_new)
            comps.append(computed)
            budget -= num_new

        # 2) Waiting requests, unless memory was short this step: admitting now would
        # only preempt again next step.
        num_from_running = len(reqs)
        self.pending_prefill_blocks = pending_blocks
        self.pending_prefill_tokens = pending_tokens
        if self.num_preemptions == preempted_before:
            admit_waiting(self, now, budget, step_budget, threshold, chunked, out)
            # 3) Draft tokens, last: only budget and blocks nothing else took.
            if self.spec is not None:
                schedule_drafts(self, out, num_from_running, step_budget)
        else:
            # Victims were removed from this step: count the prefill tokens again.
            num_from_running = num_prefill = 0
        for j in range(num_from_running, len(reqs)):
            req, n, c = reqs[j], nums[j], comps[j]
            if n != 1 or c < req.num_prompt_tokens or c + 1 != len(req.all_token_ids):
                num_prefill += n
        total = sum(nums)
        num_decode = total - num_prefill - out.num_spec_tokens
        ctx = sum(comps) + total
        out.total_num_scheduled_tokens = total
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
        stats.num_scheduled_tokens = total
        stats.num_prefill_tokens = num_prefill
        stats.num_decode_tokens = num_decode
        stats.num_scheduled_reqs = len(reqs)
        stats.num_spec_tokens = out.num_spec_tokens
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
            self.preempt(victim, out)
            if victim is req:
                return False
        return True

    def _reserve_for_admission(
        self, req: Request, max_new: int, out: SchedulerOutput
    ) -> tuple[int, int] | None:
        return reserve_for_admission(self, req, max_new, out)

    def _start_running(self, req: Request, now: float) -> None:
        """Move the policy's head (``req``, just reserved) into the running set."""
        self.policy.pop()
        start_running(self, req, now)

    def preempt(self, victim: Request, out: SchedulerOutput) -> None:
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
            victim.num_external_computed_tokens = 0  # its transferred KV went too
        victim.spec_token_ids = []
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted_req_ids.append(victim.request_id)
        self.policy.push_front(victim)

    # -- after the step -------------------------------------------------------------------

    def update(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput, now: float
    ) -> EngineCoreOutputs:
        self.policy.observe_step(scheduler_output, now - self.schedule_time)
        spec_rows = scheduler_output.scheduled_spec_decode_tokens
        if self.spec is not None:
            so = scheduler_output
            self.spec.observe_step(so.num_prefill_tokens + so.num_spec_tokens,
                                   so.num_decode_tokens, so.num_context_tokens,
                                   now - self.schedule_time)
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
            if spec_rows and req.request_id in spec_rows:
                if update_spec_request(self, req, spec_rows, runner_output, outputs, now):
                    num_finished += 1
                continue
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
        if self.spec is not None:
            req.spec_token_ids = []
            self.spec.on_finished(req)
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
        """docs/architecture.md invariants 1, 2 and 6, checkable at any point between steps."""
        check_invariants(self)
