"""Request-level batching baselines: the schedulers continuous batching replaced.

Both subclass ``Scheduler`` and change only ``schedule()``: the KV cache manager,
policies, preemption, ``update()`` (stop conditions, freeing at once) and stats are
the production ones, so the engine and the simulator run them unchanged.

- ``static``: when the engine is idle (the previous batch has drained), admit up to
  ``static_batch_size`` waiting requests together (in policy order) and reserve
  their prompts' KV. The batch prefills (in budget-sized chunks if needed), then
  decodes in lockstep; no request joins until every member has finished.
- ``dynamic``: static, but an idle engine waits until ``static_batch_size`` requests
  wait or ``dynamic_batch_window_s`` has passed since the oldest one arrived.

Padding is charged, not executed: while the batch prefills, the step's
``num_prefill_tokens`` (and context) are scaled to ``slots x longest prompt``; while
it decodes, ``num_decode_tokens`` counts every slot of the batch, finished ones
included, and ``num_context_tokens`` is ``slots x longest context``. A cost model
therefore sees the padded work request-level batching really does (the chapter's
padding waste and tail idling); the model runner lays out the batch from
``scheduled_requests`` and ``num_scheduled_tokens`` only, so it does no padded work.
"""

from __future__ import annotations

from iterserve.config import CacheConfig, SchedulerConfig
from iterserve.core.outputs import SchedulerOutput
from iterserve.core.request import RequestStatus
from iterserve.core.scheduler import Scheduler

_RUNNING = RequestStatus.RUNNING


class StaticBatchScheduler(Scheduler):
    """Request-level batching: a batch admitted together runs until its last member ends."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig) -> None:
        super().__init__(scheduler_config, cache_config)
        self.batch_size = min(scheduler_config.static_batch_size, scheduler_config.max_num_seqs)
        # Slots of the batch in flight: finished members keep their slot (padding).
        self.num_slots = 0
        # Padded / actual prefill tokens of the batch in flight.
        self.prefill_pad_factor = 1.0
        self.num_batches = 0

    # -- when a batch may start -------------------------------------------------------

    def should_dispatch(self, now: float) -> bool:
        return len(self.policy) > 0

    def next_event_time(self, now: float) -> float | None:
        """When an idle scheduler would act without a new arrival (None: never).

        A virtual-clock driver jumps to it instead of spinning on empty steps.
        """
        return None

    # -- the per-step decision -----------------------------------------------------------

    def schedule(self, now: float) -> SchedulerOutput:
        self.step_id += 1
        out = SchedulerOutput(self.step_id, [], [], [], 0)
        reqs, nums, comps = out.scheduled_requests, out.num_scheduled_tokens, out.num_computed_tokens
        preempted_before = self.num_preemptions
        running = self.running
        if not running:
            self.num_slots = 0
            if self.should_dispatch(now):
                self._dispatch(now, out)
                running = self.running

        bs = self.block_size
        max_budget = self.max_num_batched_tokens
        budget = max_budget
        threshold = self.long_prefill_token_threshold
        # Lockstep: no member decodes until every member's prefill is done.
        prefilling = [r for r in running if len(r.all_token_ids) - r.num_computed_tokens > 1]
        for req in prefilling or list(running):
            if budget <= 0:
                break
            if req.status is not _RUNNING:
                continue  # preempted earlier in this step
            computed = req.num_computed_tokens
            num_new = min(len(req.all_token_ids) - computed, threshold, budget)
            if computed + num_new > len(req.block_ids) * bs:
                before = self.num_preemptions
                fits = self._grow_or_preempt(req, num_new, out)
                if self.num_preemptions != before:
                    budget = max_budget - sum(nums)
                    if not fits:
                        continue
            reqs.append(req)
            nums.append(num_new)
            comps.append(computed)
            budget -= num_new

        num_prefill = num_decode = ctx = max_ctx = 0
        for req, n, c in zip(reqs, nums, comps):
            ctx += c + n
            if c + n > max_ctx:
                max_ctx = c + n
            if n == 1 and c >= req.num_prompt_tokens and c + 1 == len(req.all_token_ids):
                num_decode += 1
            else:
                num_prefill += n
        out.total_num_scheduled_tokens = num_prefill + num_decode
        if reqs:
            if prefilling:
                out.num_prefill_tokens = round(num_prefill * self.prefill_pad_factor)
                out.num_decode_tokens = num_decode
                out.num_context_tokens = round(ctx * self.prefill_pad_factor)
            else:
                slots = max(self.num_slots, len(reqs))
                out.num_prefill_tokens = num_prefill
                out.num_decode_tokens = slots if num_decode else 0
                out.num_context_tokens = slots * max_ctx
        if self.finished_req_ids:
            out.finished_req_ids = self.finished_req_ids
            self.finished_req_ids = []
        self._fill_stats(out, preempted_before)
        return out

    def _dispatch(self, now: float, out: SchedulerOutput) -> None:
        """Admit up to ``batch_size`` waiting requests together, reserving each prompt's KV."""
        policy = self.policy
        running = self.running
        padded_len = actual = 0
        while len(running) < self.batch_size:
            req = policy.peek()
            if req is None:
                break
            # The whole prompt's KV is reserved now: a static batch never grows.
            if self._reserve_for_admission(req, len(req.all_token_ids), out) is None:
                break  # the rest waits for the next batch
            self._start_running(req, now)
            todo = len(req.all_token_ids) - req.num_computed_tokens
            padded_len = max(padded_len, todo)
            actual += todo
        self.num_slots = len(running)
        if running:
            self.num_batches += 1
        self.prefill_pad_factor = self.num_slots * padded_len / actual if actual else 1.0

    def _fill_stats(self, out: SchedulerOutput, preempted_before: int) -> None:
        stats = self.stats
        stats.step_id = self.step_id
        stats.num_running = len(self.running)
        stats.num_waiting = len(self.policy)
        stats.num_swapped = self.kv.num_swapped_requests
        stats.kv_cache_usage = self.kv.pool.usage
        stats.prefix_cache_queries = self.kv.prefix_cache_queries
        stats.prefix_cache_hits = self.kv.prefix_cache_hits
        stats.num_preemptions = self.num_preemptions
        stats.step_num_preemptions = self.num_preemptions - preempted_before
        stats.num_scheduled_tokens = out.total_num_scheduled_tokens
        stats.num_prefill_tokens = out.num_prefill_tokens
        stats.num_decode_tokens = out.num_decode_tokens
        stats.num_scheduled_reqs = len(out.scheduled_requests)


class DynamicBatchScheduler(StaticBatchScheduler):
    """Static batching whose idle engine waits for a full batch or a time window."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig) -> None:
        super().__init__(scheduler_config, cache_config)
        self.window_s = scheduler_config.dynamic_batch_window_s

    def _oldest_arrival(self) -> float:
        return min(r.arrival_time for r in self.policy)

    def should_dispatch(self, now: float) -> bool:
        n = len(self.policy)
        if n == 0:
            return False
        return n >= self.batch_size or now - self._oldest_arrival() >= self.window_s

    def next_event_time(self, now: float) -> float | None:
        if self.running or not len(self.policy):
            return None
        return self._oldest_arrival() + self.window_s


BASELINE_SCHEDULERS: dict[str, type[Scheduler]] = {
    "static": StaticBatchScheduler,
    "dynamic": DynamicBatchScheduler,
}


def make_baseline_scheduler(scheduler_config: SchedulerConfig, cache_config: CacheConfig) -> Scheduler:
    try:
        cls = BASELINE_SCHEDULERS[scheduler_config.scheduler]
    except KeyError:
        raise ValueError(
            f"unknown baseline scheduler {scheduler_config.scheduler!r}; "
            f"choose one of {', '.join(BASELINE_SCHEDULERS)}"
        ) from None
    return cls(scheduler_config, cache_config)


__all__ = ["DynamicBatchScheduler", "StaticBatchScheduler", "make_baseline_scheduler"]

