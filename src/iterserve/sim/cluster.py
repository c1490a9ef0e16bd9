"""N replicas behind a router on one virtual clock: the cluster a ``--data-parallel-size``
deployment runs, simulated.

Each replica is a production ``EngineCore`` with its own ``SimulatedExecutor`` and
clock; the router is the very policy object a served cluster uses
(``iterserve.cluster.make_policy``). A request is routed when it arrives, from its
prompt's block keys (``RequestView.from_prompt`` with the replicas' block size and
hash algorithm), to one replica, where it runs to its end; the policy hears of the
routing and of the end. Replica stats (running, waiting, KV usage, cached blocks,
prefix-cache counters) reach the policy before every decision, or, with
``stats_period_s``, only every that many simulated seconds, as a Ray Serve router
polls its replicas.

The event loop: the next event is the earliest of the next arrival, the next stats
poll and the earliest step start of a busy replica (ties in that order, replicas by
index). A step runs whole: requests that arrive while it runs wait for the replica's
next step, as in the single-replica loop, which this one equals for one replica.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from iterserve.cluster import ReplicaStats, ReplicaView, RequestView, RoutingPolicy, make_policy
from iterserve.config import CacheConfig, SchedulerConfig
from iterserve.core.outputs import EngineCoreOutputs
from iterserve.core.request import Request
from iterserve.core.sampling_params import SamplingParams
from iterserve.engine.core import EngineCore
from iterserve.sim.cost_model import CostModel
from iterserve.sim.executor import SIM_EOS_TOKEN_ID, SimulatedExecutor, VirtualClock
from iterserve.sim.result import SimResult, StepLog, build_result
from iterserve.sim.simulator import ItlTracker, compute_metrics
from iterserve.sim.workload import Workload, prompt_token_ids


@dataclass(slots=True)
class ReplicaLoad:
    """What one replica served in a run."""

    replica_id: str
    num_requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    busy_time_s: float = 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_queries
        return self.prefix_cache_hits / q if q else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "replica_id": self.replica_id, "num_requests": self.num_requests,
            "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
            "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
            "num_preemptions": self.num_preemptions, "busy_time_s": self.busy_time_s,
        }


class _Replica:
    """One engine on its own clock: the clock is when its next step may start."""

    def __init__(self, replica_id: str, sc: SchedulerConfig, cc: CacheConfig,
                 cost: CostModel, t0: float, record_itl: bool) -> None:
        self.replica_id = replica_id
        self.clock = VirtualClock(t0)
        self.executor = SimulatedExecutor(cost, self.clock)
        self.engine = EngineCore(sc, cc, self.executor, clock=self.clock.now)
        self.sched = self.engine.scheduler
        self.log = StepLog()
        self.itl = ItlTracker(self.log) if record_itl else None
        self.accepted: list[Request] = []

    def snapshot(self) -> ReplicaStats:
        """The scheduler's state now, as a replica reports it to a router."""
        sched, kv = self.sched, self.sched.kv
        return ReplicaStats(
            num_running=len(sched.running), num_waiting=sched.num_waiting,
            kv_cache_usage=kv.usage, num_gpu_blocks=kv.num_blocks,
            num_cached_blocks=len(kv.pool.cached),
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
        )

    def load(self) -> ReplicaLoad:
        kv = self.sched.kv
        return ReplicaLoad(
            self.replica_id, len(self.accepted),
            sum(r.num_prompt_tokens for r in self.accepted),
            sum(r.num_output_tokens for r in self.accepted),
            kv.prefix_cache_queries, kv.prefix_cache_hits, self.sched.num_preemptions,
            self.executor.busy_time,
        )


class ClusterSimulator:
    """A workload through ``num_replicas`` simulated engines behind ``router_policy``."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        cost_model: CostModel,
        *,
        num_replicas: int,
        router_policy: str = "round_robin",
        policy_options: dict[str, Any] | None = None,
        stats_period_s: float = 0.0,
        record_itl: bool = True,
        vocab_size: int = 32000,
        label: str | None = None,
    ) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if not stats_period_s >= 0:
            raise ValueError(f"stats_period_s must be >= 0, got {stats_period_s}")
        if cache_config.num_gpu_blocks is None:
            raise ValueError("cache_config.num_gpu_blocks must be set for a simulation")
        make_policy(router_policy, **(policy_options or {}))  # a bad name or option: now
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.cost_model = cost_model
        self.num_replicas = num_replicas
        self.router_policy = router_policy
        self.policy_options = dict(policy_options or {})
        self.stats_period_s = stats_period_s
        self.record_itl = record_itl
        self.vocab_size = vocab_size
        self.label = label or router_policy
        # Set by run(): the last run's policy, replicas and routing, for tests.
        self.policy: RoutingPolicy | None = None
        self.replicas: list[_Replica] = []
        self.routed_to: dict[str, str] = {}
        self.finish_counts: dict[str, int] = {}
        self.poll_times: list[float] = []

    def run(self, workload: Workload) -> SimResult:
        wall0 = time.perf_counter()
        specs = workload.requests
        n = len(specs)
        sc, cc = self.scheduler_config, self.cache_config
        t0 = specs[0].arrival_time if n else 0.0
        reps = [_Replica(f"replica-{k}", sc, cc, self.cost_model, t0, self.record_itl)
                for k in range(self.num_replicas)]
        by_id = {r.replica_id: r for r in reps}
        policy = make_policy(self.router_policy, **self.policy_options)
        self.policy, self.replicas = policy, reps
        routed_to: dict[str, str] = {}
        finish_counts: dict[str, int] = {}
        self.routed_to, self.finish_counts = routed_to, finish_counts
        poll_times: list[float] = []
        self.poll_times = poll_times
        in_flight: dict[str, RequestView] = {}
        views = [ReplicaView(r.replica_id) for r in reps]

        def poll() -> None:
            for k, r in enumerate(reps):
                st = r.snapshot()
                policy.update_stats(r.replica_id, st)
                views[k] = ReplicaView(r.replica_id, st.num_running, st.num_waiting)

        def finish(rid: str, replica_id: str) -> None:
            policy.on_finished(in_flight.pop(rid), replica_id)
            finish_counts[rid] = finish_counts.get(rid, 0) + 1

        period = self.stats_period_s
        next_poll = t0 if period > 0 else math.inf
        params: dict[int | None, SamplingParams] = {}
        num_rejected = 0
        inf = math.inf
        i = 0
        while True:
            busy: _Replica | None = None
            t_step = inf
            for r in reps:
                if r.sched.requests and r.clock.t < t_step:
                    busy, t_step = r, r.clock.t
            t_arr = specs[i].arrival_time if i < n else inf
            if busy is None and i >= n:
                break
            if next_poll <= t_arr and next_poll <= t_step:
                poll_times.append(next_poll)
                poll()
                next_poll = t0 + len(poll_times) * period
                continue
            if t_arr <= t_step:
                spec = specs[i]
                rid = str(i)
                ids = prompt_token_ids(spec, i, self.vocab_size)
                view = RequestView.from_prompt(
                    rid, ids, block_size=cc.block_size, hash_algo=cc.prefix_caching_hash_algo,
                    session_key=spec.session_id,
                )
                if period == 0:
                    poll()
                target = by_id[policy.choose(view, views)]
                sp = params.get(spec.max_tokens)
                if sp is None:
                    sp = params[spec.max_tokens] = SamplingParams(
                        max_tokens=spec.max_tokens, temperature=0.0)
                req = Request(rid, ids, sp, spec.arrival_time, eos_token_id=SIM_EOS_TOKEN_ID,
                              priority=spec.priority, tenant=spec.tenant)
                if not target.sched.requests:  # idle: its next step starts now
                    target.clock.advance_to(t_arr)
                policy.on_routed(view, target.replica_id)
                in_flight[rid] = view
                routed_to[rid] = target.replica_id
                try:
                    target.engine.add_request(req)
                except ValueError:  # the replica refuses it: it ends at once
                    num_rejected += 1
                    finish(rid, target.replica_id)
                else:
                    target.executor.set_output_len(rid, spec.prompt_len, spec.output_len)
                    target.accepted.append(req)
                i += 1
                continue
            assert busy is not None
            self._step(busy, t_arr, finish)
        return self._result(reps, num_rejected, time.perf_counter() - wall0)

    def _step(self, rep: _Replica, t_arr: float, finish: Any) -> None:
        now = rep.clock.t
        outs = rep.engine.step()
        dt = rep.clock.t - now
        rep.log.record_step(now, dt, rep.sched.stats)
        if dt == 0.0:
            # Nothing ran (a baseline waiting for its window): wait for its wake-up or
            # the next arrival, whichever is first.
            nxt = t_arr
            next_event = getattr(rep.sched, "next_event_time", None)
            wake = next_event(now) if next_event is not None else None
            if wake is not None and now < wake < nxt:
                nxt = wake
            if nxt == math.inf or nxt <= now:
                raise RuntimeError(
                    f"simulation stalled at t={now:.3f}s on {rep.replica_id}: "
                    f"{len(rep.sched.requests)} unfinished requests but nothing scheduled"
                )
            rep.clock.t = nxt
            return
        if isinstance(outs, EngineCoreOutputs):
            token_rids, finished = outs.req_ids, outs.finished
        else:  # a failed or empty step
            token_rids = [o.request_id for o in outs if o.new_token_ids]
            finished = {o.request_id: o for o in outs if o.finish_reason is not None}
        if rep.itl is not None:
            rep.itl.record(rep.clock.t, token_rids, finished)
        for rid in finished:
            finish(rid, rep.replica_id)

    def _result(self, reps: list[_Replica], num_rejected: int, wall: float) -> SimResult:
        """One result for the cluster: every request (arrival order), every replica's
        steps (by start time), totals; per-replica loads in ``replicas``."""
        reqs = sorted((q for r in reps for q in r.accepted), key=lambda q: int(q.request_id))
        parts = [build_result(r.replica_id, r.accepted, r.log, num_rejected=0,
                              num_preemptions_total=0, prefix_cache_queries=0,
                              prefix_cache_hits=0, wall_time_s=0.0, config={}) for r in reps]
        res = build_result(
            self.label, reqs, StepLog(), num_rejected=num_rejected,
            num_preemptions_total=sum(r.sched.num_preemptions for r in reps),
            prefix_cache_queries=sum(r.sched.kv.prefix_cache_queries for r in reps),
            prefix_cache_hits=sum(r.sched.kv.prefix_cache_hits for r in reps),
            wall_time_s=wall, config=self.describe(),
        )
        order = np.argsort(np.concatenate([p.step_time for p in parts]), kind="stable")
        for name in ("step_time", "step_dt", "step_running", "step_waiting", "step_batch",
                     "step_tokens", "step_kv_usage"):
            setattr(res, name, np.concatenate([getattr(p, name) for p in parts])[order])
        res.itl = np.concatenate([p.itl for p in parts])
        res.replicas = [r.load().as_dict() for r in reps]
        return res

    def describe(self) -> dict[str, Any]:
        sc, cc = self.scheduler_config, self.cache_config
        return {
            "num_replicas": self.num_replicas, "router_policy": self.router_policy,
            "policy_options": self.policy_options, "stats_period_s": self.stats_period_s,
            "scheduler": sc.scheduler, "policy": sc.scheduling_policy,
            "max_num_seqs": sc.max_num_seqs,
            "max_num_batched_tokens": sc.max_num_batched_tokens,
            "block_size": cc.block_size, "num_gpu_blocks": cc.num_gpu_blocks,
            "enable_prefix_caching": cc.enable_prefix_caching,
            "cost_model": self.cost_model.to_dict(),
        }


def cluster_metrics(r: SimResult, goodput: dict[str, float] | None = None) -> dict[str, Any]:
    """``compute_metrics`` for the cluster, plus the per-replica loads and their spread.

    Step statistics are over every replica's steps; ``busy_fraction`` is the mean
    replica's."""
    m = compute_metrics(r, goodput)
    reps = r.replicas
    if reps:
        if "busy_fraction" in m:
            m["busy_fraction"] /= len(reps)
        counts = np.array([x["num_requests"] for x in reps], dtype=np.float64)
        m["replicas"] = reps
        m["num_replicas"] = len(reps)
        # max / mean requests per replica: 1 is an even split, N all on one replica.
        m["replica_imbalance"] = float(counts.max() / counts.mean()) if counts.sum() else 0.0
    return m


def format_replica_table(columns: list[tuple[str, dict[str, Any]]]) -> str:
    """Per replica and run: requests, prompt tokens, prefix-cache hit rate (Markdown)."""
    head = "| replica | " + " | ".join(
        f"{label} requests | {label} prompt tok | {label} hit rate" for label, _ in columns)
    lines = [head + " |", "|---" * (1 + 3 * len(columns)) + "|"]
    n = max((len(m.get("replicas", [])) for _, m in columns), default=0)
    for k in range(n):
        cells = [f"{k}"]
        for _, m in columns:
            reps = m.get("replicas", [])
            if k < len(reps):
                x = reps[k]
                cells += [f"{x['num_requests']:,}", f"{x['prompt_tokens']:,}",
                          f"{x['prefix_cache_hit_rate']:.1%}"]
            else:
                cells += ["-", "-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
