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
from array import array
from dataclasses import dataclass, field

import numpy as np

from iterserve.config import CacheConfig, SchedulerConfig
from iterserve.core.outputs import EngineCoreOutputs
from iterserve.core.request import Request
from iterserve.core.sampling_params import SamplingParams
from iterserve.engine.core import EngineCore
from iterserve.measure.latency import RequestLatencies
from iterserve.measure.summary import latency_stats, meets_slos
from iterserve.sim.cost_model import CostModel
from iterserve.sim.executor import SIM_EOS_TOKEN_ID, SimulatedExecutor, VirtualClock
from iterserve.sim.workload import Workload, to_request

# ---------------------------------------------------------------------------
# Little's-law stability check
# ---------------------------------------------------------------------------


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
    tau = cost_model.time_for(
        num_prefill_tokens=b * p / d, num_decode_seqs=b, num_context_tokens=b * (p + d / 2)
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


# ---------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------


@dataclass
class SimResult:
    """Raw records of one run; ``metrics`` summarises them."""

    label: str
    # Per request (arrays over accepted requests, in arrival order).
    arrival: np.ndarray
    first_scheduled: np.ndarray
    first_token: np.ndarray
    finished: np.ndarray
    prompt_len: np.ndarray
    output_len: np.ndarray  # tokens actually generated
    num_preemptions: np.ndarray
    itl: np.ndarray  # every inter-token latency, seconds
    # Per step (at schedule time; dt = the step's simulated duration).
    step_time: np.ndarray
    step_dt: np.ndarray
    step_running: np.ndarray
    step_waiting: np.ndarray
    step_batch: np.ndarray
    step_tokens: np.ndarray
    step_kv_usage: np.ndarray
    num_rejected: int = 0
    num_preemptions_total: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    wall_time_s: float = 0.0
    config: dict = field(default_factory=dict)
    stability: StabilityCheck | None = None
    metrics: dict = field(default_factory=dict)

    @property
    def num_steps(self) -> int:
        return len(self.step_time)


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


class Simulator:
    """Runs workloads through ``EngineCore`` + ``SimulatedExecutor`` on a virtual clock."""

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
    ) -> None:
        if cache_config.num_gpu_blocks is None:
            raise ValueError("cache_config.num_gpu_blocks must be set for a simulation")
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
        executor = SimulatedExecutor(self.cost_model, clock)
        engine = EngineCore(self.scheduler_config, self.cache_config, executor, clock=clock.now)
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

        st_t, st_dt = array("d"), array("d")
        st_run, st_wait, st_batch, st_tok = array("l"), array("l"), array("l"), array("l")
        st_kv = array("d")
        # Inter-token latencies as (value, count) pairs. Most tokens come from requests
        # that also got one in the previous step, and all of those share one ITL (the
        # time since that step): counted with set operations instead of per token.
        itl_val, itl_cnt = array("d"), array("q")
        record_itl = self.record_itl
        prev_ids: set[str] = set()  # requests that got a token in the previous step
        prev_t = 0.0
        last_tok: dict[str, float] = {}  # last token time of requests not in prev_ids

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
            if record_itl:
                t = clock.t
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
                prev_ids, prev_t = cur_ids, t
            num_done += len(finished)
            if bar is not None and num_done - bar_done >= 256:
                bar.update(num_done - bar_done)
                bar_done = num_done
        if bar is not None:
            bar.update(n - bar_done)
            bar.close()
        wall = time.perf_counter() - wall0

        nan = math.nan
        reqs = [r for _, r in accepted]

        def col(attr: str) -> np.ndarray:
            return np.array(
                [nan if (v := getattr(r, attr)) is None else v for r in reqs], dtype=np.float64
            )

        result = SimResult(
            label=self.label,
            arrival=np.array([r.arrival_time for r in reqs], dtype=np.float64),
            first_scheduled=col("first_scheduled_time"),
            first_token=col("first_token_time"),
            finished=col("finished_time"),
            prompt_len=np.array([r.num_prompt_tokens for r in reqs], dtype=np.int64),
            output_len=np.array([r.num_output_tokens for r in reqs], dtype=np.int64),
            num_preemptions=np.array([r.num_preemptions for r in reqs], dtype=np.int64),
            itl=np.repeat(np.frombuffer(itl_val, dtype=np.float64), np.frombuffer(itl_cnt, dtype=np.int64))
            if len(itl_val) else np.zeros(0),
            step_time=np.frombuffer(st_t, dtype=np.float64) if len(st_t) else np.zeros(0),
            step_dt=np.frombuffer(st_dt, dtype=np.float64) if len(st_dt) else np.zeros(0),
            step_running=np.array(st_run, dtype=np.int64),
            step_waiting=np.array(st_wait, dtype=np.int64),
            step_batch=np.array(st_batch, dtype=np.int64),
            step_tokens=np.array(st_tok, dtype=np.int64),
            step_kv_usage=np.frombuffer(st_kv, dtype=np.float64) if len(st_kv) else np.zeros(0),
            num_rejected=num_rejected,
            num_preemptions_total=sched.num_preemptions,
            prefix_cache_queries=sched.kv.prefix_cache_queries,
            prefix_cache_hits=sched.kv.prefix_cache_hits,
            wall_time_s=wall,
            config=self.describe(),
        )
        return result

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
