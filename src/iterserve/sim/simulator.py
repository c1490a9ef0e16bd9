"""The discrete-event loop: a workload through the production EngineCore on a virtual clock.

Nothing here decides what runs: ``EngineCore.step()`` calls the real scheduler,
whose SchedulerOutput goes to the ``SimulatedExecutor`` (the cost model advances
the clock, the hidden output lengths decide EOS), then back to the real
``update()``. The loop only admits arrivals whose time has come, jumps the
clock over idle gaps, and records what happened.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Collection, Sequence

import numpy as np

from iterserve.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from iterserve.core.outputs import EngineCoreOutputs
from iterserve.core.request import Request
from iterserve.core.sampling_params import SamplingParams
from iterserve.engine.core import EngineCore
from iterserve.measure.latency import RequestLatencies
from iterserve.measure.summary import latency_stats, meets_slos
from iterserve.sim.cost_model import CostModel
from iterserve.sim.executor import SIM_EOS_TOKEN_ID, SimulatedExecutor, VirtualClock
from iterserve.sim.result import SimResult, StepLog, build_result
from iterserve.sim.speculative import AcceptanceModel, AcceptanceProposer, AcceptanceSampler
from iterserve.sim.stability import StabilityCheck, stability_check
from iterserve.sim.workload import Workload, to_request

__all__ = [
    "ItlTracker",
    "SimResult",
    "Simulator",
    "StabilityCheck",
    "compute_metrics",
    "littles_law",
    "simulate",
    "stability_check",
]

# ---------------------------------------------------------------------------
# Metric summary: one run's records -> the numbers reports print
# ---------------------------------------------------------------------------




def compute_metrics(r: SimResult, goodput: dict[str, float] | None = None) -> dict:
    """Throughput, latency distributions (ms), goodput, batch/KV statistics, Little's law."""
    n = len(r.arrival)
    done = ~np.isnan(r.finished)
    t_start = float(r.arrival.min()) if n else 0.0
    t_end = float(np.nanmax(r.finished)) if done.any() else t_start
    duration = max(t_end - t_start, 1e-12)
    lat = RequestLatencies.from_times(
        r.arrival, r.first_scheduled, r.first_token, r.finished, r.output_len
    ).select(done)
    out: np.ndarray = r.output_len.astype(np.float64)
    m: dict = {
        "num_requests": n,
        "num_completed": int(done.sum()),
        "num_rejected": r.num_rejected,
        "duration_s": duration,
        "request_throughput": float(done.sum()) / duration,
        "output_token_throughput": float(out[done].sum()) / duration,
        "total_token_throughput": float(out[done].sum() + r.prompt_len[done].sum()) / duration,
        "ttft_ms": latency_stats(lat.ttft).as_dict(),
        "tpot_ms": latency_stats(lat.tpot).as_dict(),
        "itl_ms": latency_stats(r.itl).as_dict(),
        "e2e_ms": latency_stats(lat.e2e).as_dict(),
        "queue_ms": latency_stats(lat.queue).as_dict(),
        "num_preemptions": r.num_preemptions_total,
        "prefix_cache_hit_rate": (
            r.prefix_cache_hits / r.prefix_cache_queries if r.prefix_cache_queries else 0.0
        ),
        "num_steps": r.num_steps,
        "wall_time_s": r.wall_time_s,
    }
    busy = float(r.step_dt.sum())
    if r.num_steps:
        w = r.step_dt
        m["mean_batch_size"] = float((r.step_batch * w).sum() / busy) if busy else 0.0
        m["mean_batch_size_per_step"] = float(r.step_batch.mean())
        m["mean_kv_usage"] = float((r.step_kv_usage * w).sum() / busy) if busy else 0.0
        m["max_kv_usage"] = float(r.step_kv_usage.max())
        m["max_waiting"] = int(r.step_waiting.max())
        m["busy_fraction"] = busy / duration
    if goodput:
        num_good = float(meets_slos(lat, goodput).sum())
        m["goodput"] = {"slos_ms": dict(goodput), "requests_per_s": num_good / duration,
                        "fraction": num_good / max(n, 1)}
    m["littles_law"] = littles_law(r)
    if r.wall_time_s > 0:
        m["sim_requests_per_wall_s"] = n / r.wall_time_s
        m["sim_steps_per_wall_s"] = r.num_steps / r.wall_time_s
    return m


def littles_law(r: SimResult, warmup: float = 0.1) -> dict[str, float]:
    """L (time-average requests in system, from per-step counts) vs lambda * W (throughput x
    mean latency), over the steady middle of the run (``warmup`` trimmed at each end)."""
    done = ~np.isnan(r.finished)
    if done.sum() < 2 or r.num_steps < 2:
        return {"L": math.nan, "lambda_W": math.nan, "rel_error": math.nan}
    # The window lies inside the arrival span: after the last arrival the system
    # drains, which is not a steady state.
    t0, t1 = float(r.arrival.min()), float(r.arrival.max())
    if t1 <= t0:
        return {"L": math.nan, "lambda_W": math.nan, "rel_error": math.nan}
    a, b = t0 + warmup * (t1 - t0), t1 - warmup * (t1 - t0)
    # Requests in system between steps are those counted at the step that follows;
    # idle gaps hold none. Integrate the per-step count over [a, b].
    st = r.step_time
    end = st + r.step_dt
    lo, hi = np.clip(st, a, b), np.clip(end, a, b)
    L = float(((r.step_running + r.step_waiting) * (hi - lo)).sum()) / (b - a)
    # lambda * W over the same window: total time requests spent in [a, b] / (b - a)
    # equals L exactly; the check compares it with throughput x mean latency of the
    # requests that arrived in the window, which is what Little's law asserts.
    fin = r.finished[done]
    arr = r.arrival[done]
    in_win = (arr >= a) & (arr < b)
    lam = in_win.sum() / (b - a)
    W = float((fin[in_win] - arr[in_win]).mean()) if in_win.any() else math.nan
    lw = float(lam * W)
    return {"L": L, "lambda_W": lw, "rel_error": abs(L - lw) / lw if lw else math.nan}


# ---------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------


class ItlTracker:
    """Inter-token latencies of one engine's steps, appended to a ``StepLog`` as
    (value, count) pairs. Most tokens come from requests that also got one in the
    previous step, and all of those share one ITL (the time since that step): counted
    with set operations instead of per token."""

    def __init__(self, log: StepLog) -> None:
        self.log = log
        self.prev_ids: set[str] = set()  # requests that got a token in the previous step
        self.prev_t = 0.0
        self.last_tok: dict[str, float] = {}  # last token time of requests not in prev_ids

    def record(self, t: float, token_rids: Sequence[str], finished: Collection[str]) -> None:
        """A step that ended at ``t``: the requests that got a token, those that ended."""
        itl_val, itl_cnt, last_tok = self.log.itl_val, self.log.itl_cnt, self.last_tok
        prev_ids, prev_t = self.prev_ids, self.prev_t
        cur_ids = set(token_rids)
        new_ids = cur_ids - prev_ids  # a first token, or the first after a gap
        num_cont = len(cur_ids) - len(new_ids)
        if num_cont:
            itl_val.append(t - prev_t)
            itl_cnt.append(num_cont)
        if num_cont < len(prev_ids):
            for rid in prev_ids - cur_ids:  # skipped this step (or preempted)
                last_tok[rid] = prev_t
        for rid in new_ids:
            p = last_tok.pop(rid, None)
            if p is not None:
                itl_val.append(t - p)
                itl_cnt.append(1)
        if finished:
            cur_ids.difference_update(finished)
            for rid in finished:
                last_tok.pop(rid, None)
        self.prev_ids, self.prev_t = cur_ids, t


class Simulator:
    """Runs workloads through ``EngineCore`` + ``SimulatedExecutor`` on a virtual clock.

    ``speculative_config`` with ``acceptance``: speculative decoding, the scheduler's
    own path, with drafts accepted by the acceptance model (``sim/speculative.py``).
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        cost_model: CostModel,
        *,
        progress: bool = False,
        record_itl: bool = True,
        vocab_size: int = 32000,
        label: str | None = None,
        speculative_config: SpeculativeConfig | None = None,
        acceptance: AcceptanceModel | None = None,
    ) -> None:
        if cache_config.num_gpu_blocks is None:
            raise ValueError("cache_config.num_gpu_blocks must be set for a simulation")
        if speculative_config is not None and acceptance is None:
            raise ValueError("speculative_config: a simulation of speculative decoding needs "
                             "an acceptance model (how often the drafts are right)")
        self.speculative_config = speculative_config
        self.acceptance = acceptance
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.cost_model = cost_model
        self.progress = progress
        self.record_itl = record_itl
        self.vocab_size = vocab_size
        self.label = label or scheduler_config.scheduler
        # Set by run(): the last engine, for tests and inspection.
        self.engine: EngineCore | None = None
        self.scheduler_outputs: list | None = None

    def check(self, workload: Workload) -> StabilityCheck:
        return stability_check(workload, self.cost_model, self.scheduler_config, self.cache_config)

    def run(self, workload: Workload, *, trace_outputs: bool = False) -> SimResult:
        """Simulate ``workload``. ``trace_outputs`` keeps every step's
        ``SchedulerOutput.summary()`` in ``self.scheduler_outputs`` (tests)."""
        wall0 = time.perf_counter()
        # The run allocates millions of short-lived objects and no cycles: pause the
        # cyclic garbage collector, whose full passes would walk every request kept.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            return self._run(workload, trace_outputs, wall0)
        finally:
            if gc_was_enabled:
                gc.enable()

    def _run(self, workload: Workload, trace_outputs: bool, wall0: float) -> SimResult:
        specs = workload.requests
        n = len(specs)
        clock = VirtualClock(specs[0].arrival_time if n else 0.0)
        spec_cfg, acc = self.speculative_config, self.acceptance
        sampler, proposer = None, None
        if spec_cfg is not None and acc is not None:
            sampler = AcceptanceSampler(acc)
            proposer = AcceptanceProposer(spec_cfg, acc,
                                          max_model_len=self.scheduler_config.max_model_len)
        executor = SimulatedExecutor(self.cost_model, clock, acceptance=sampler)
        engine = EngineCore(self.scheduler_config, self.cache_config, executor, clock=clock.now,
                            speculative_config=spec_cfg, proposer=proposer)
        self.engine = engine
        sched = engine.scheduler
        stats = sched.stats
        next_event = getattr(sched, "next_event_time", None)
        summaries: list | None = [] if trace_outputs else None
        self.scheduler_outputs = summaries

        arrivals = [s.arrival_time for s in specs]
        accepted: list[tuple[int, Request]] = []
        num_rejected = 0
        eos_at = executor.eos_at
        # One SamplingParams per distinct max_tokens: building one validates every field.
        params_cache: dict[int | None, SamplingParams] = {}
        vocab = self.vocab_size

        log = StepLog()
        st_t, st_dt, st_kv = log.t, log.dt, log.kv
        st_run, st_wait, st_batch, st_tok = log.running, log.waiting, log.batch, log.tokens
        itl = ItlTracker(log) if self.record_itl else None

        bar = None
        if self.progress:
            from tqdm import tqdm

            bar = tqdm(total=n, desc=f"simulate[{self.label}]", unit="req", mininterval=0.5)
        num_done = 0
        bar_done = 0
        step = engine.step
        i = 0
        inf = math.inf
        while True:
            now = clock.t
            while i < n and arrivals[i] <= now:
                spec = specs[i]
                sp = params_cache.get(spec.max_tokens)
                if sp is None:
                    sp = params_cache[spec.max_tokens] = SamplingParams(
                        max_tokens=spec.max_tokens, temperature=0.0
                    )
                rid = str(i)
                req = to_request(spec, i, SIM_EOS_TOKEN_ID, request_id=rid,
                                 sampling_params=sp, vocab_size=vocab)
                try:
                    engine.add_request(req)
                except ValueError:
                    num_rejected += 1
                else:
                    eos_at[rid] = spec.prompt_len + spec.output_len - 1
                    accepted.append((i, req))
                i += 1
            if not sched.requests:  # idle: jump to the next arrival
                if i >= n:
                    break
                clock.t = arrivals[i]
                continue
            outs = step()
            dt = clock.t - now
            st_t.append(now)
            st_dt.append(dt)
            st_run.append(stats.num_running)
            st_wait.append(stats.num_waiting)
            st_batch.append(stats.num_scheduled_reqs)
            st_tok.append(stats.num_scheduled_tokens)
            st_kv.append(stats.kv_cache_usage)
            if summaries is not None and engine.last_scheduler_output is not None:
                summaries.append(engine.last_scheduler_output.summary())
            if dt == 0.0:
                # Nothing ran (a baseline waiting for its window): jump to the next event.
                nxt = arrivals[i] if i < n else inf
                wake = next_event(now) if next_event is not None else None
                if wake is not None and now < wake < nxt:
                    nxt = wake
                if nxt == inf or nxt <= now:
                    raise RuntimeError(
                        f"simulation stalled at t={now:.3f}s: {len(sched.requests)} unfinished "
                        "requests but the scheduler schedules nothing and no arrival is due"
                    )
                clock.t = nxt
                continue
            # The step's outputs in column form (EngineCoreOutputs): no object per token.
            if isinstance(outs, EngineCoreOutputs):
                token_rids, finished = outs.req_ids, outs.finished
            else:  # a failed or empty step
                token_rids = [o.request_id for o in outs if o.new_token_ids]
                finished = {o.request_id: o for o in outs if o.finish_reason is not None}
            if itl is not None:
                itl.record(clock.t, token_rids, finished)
            num_done += len(finished)
            if bar is not None and num_done - bar_done >= 256:
                bar.update(num_done - bar_done)
                bar_done = num_done
        if bar is not None:
            bar.update(n - bar_done)
            bar.close()
        wall = time.perf_counter() - wall0

        return build_result(
            self.label,
            [r for _, r in accepted],
            log,
            num_rejected=num_rejected,
            num_preemptions_total=sched.num_preemptions,
            prefix_cache_queries=sched.kv.prefix_cache_queries,
            prefix_cache_hits=sched.kv.prefix_cache_hits,
            wall_time_s=wall,
            config=self.describe(),
        )

    def describe(self) -> dict:
        sc, cc, cm = self.scheduler_config, self.cache_config, self.cost_model
        return {
            "scheduler": sc.scheduler,
            "policy": sc.scheduling_policy,
            "max_num_seqs": sc.max_num_seqs,
            "max_num_batched_tokens": sc.max_num_batched_tokens,
            "enable_chunked_prefill": sc.enable_chunked_prefill,
            "preemption_mode": sc.preemption_mode,
            "static_batch_size": sc.static_batch_size,
            "dynamic_batch_window_s": sc.dynamic_batch_window_s,
            "block_size": cc.block_size,
            "num_gpu_blocks": cc.num_gpu_blocks,
            "enable_prefix_caching": cc.enable_prefix_caching,
            "cost_model": cm.to_dict(),
            **({"speculative_config": self.speculative_config.to_dict(),
                "acceptance": self.acceptance.to_dict() if self.acceptance else None}
               if self.speculative_config is not None else {}),
        }


def simulate(
    workload: Workload,
    scheduler_config: SchedulerConfig,
    cache_config: CacheConfig,
    cost_model: CostModel,
    *,
    goodput: dict[str, float] | None = None,
    progress: bool = False,
    label: str | None = None,
) -> SimResult:
    """One run with its stability check and metrics filled in."""
    sim = Simulator(scheduler_config, cache_config, cost_model, progress=progress, label=label)
    check = sim.check(workload)
    result = sim.run(workload)
    result.stability = check
    result.metrics = compute_metrics(result, goodput)
    return result
