"""Prefill/decode disaggregation in the simulator: a prefill pool, a KV link, a decode pool.

A request is routed on arrival to a prefill replica (the production router policy,
cache-aware by default), which runs it through its production scheduler as a request
with ``max_tokens`` 1: its first token ends the prefill (TTFT, as Splitwise and
DistServe count it: that token streams from the prefill replica). Its KV, ``kv bytes
per token x prompt tokens``, then crosses the prefill replica's link to the decode
replica the decode policy (load-aware by default) picks at that moment: transfers
out of one prefill replica queue on its link (one at a time, first come first
served), each costing the link's latency plus its bytes over the bandwidth. On
arrival the decode replica's scheduler gets the request with the prompt's KV present
(``Request.num_external_computed_tokens``): admission allocates its blocks and counts
them computed, so its first step is a decode of the first token, never a recompute of
the prompt (unless the decode replica preempts it by recompute, as it would any).

The event loop is ``ClusterSimulator``'s with one more kind of event: the earliest of
the next arrival, the next KV event (a prefill finished, a transfer landed), and the
earliest step start of a busy replica of either pool (ties in that order, prefill
replicas before decode, by index).
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from iterserve.cluster import ReplicaView, RequestView, RoutingPolicy, make_policy
from iterserve.config import CacheConfig, SchedulerConfig
from iterserve.core.outputs import EngineCoreOutputs
from iterserve.core.request import Request
from iterserve.core.sampling_params import SamplingParams
from iterserve.measure.latency import RequestLatencies
from iterserve.measure.summary import latency_stats, meets_slos
from iterserve.sim.cluster import _Replica
from iterserve.sim.cost_model import CostModel
from iterserve.sim.executor import SIM_EOS_TOKEN_ID, SIM_TOKEN_ID
from iterserve.sim.result import SimResult, StepLog, build_result
from iterserve.sim.simulator import compute_metrics
from iterserve.sim.workload import Workload, prompt_token_ids

__all__ = ["DisaggRun", "DisaggSimulator", "KVLink", "PhaseConfig", "pd_metrics"]


@dataclass(slots=True)
class KVLink:
    """A prefill replica's link for KV transfers: ``bandwidth_gbps`` gigabits per
    second, ``latency_s`` per transfer (setup, the first byte)."""

    bandwidth_gbps: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.bandwidth_gbps) and self.bandwidth_gbps > 0):
            raise ValueError(f"kv_link_gbps must be > 0, got {self.bandwidth_gbps}")
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(f"kv_link_latency must be >= 0, got {self.latency_s}")

    def transfer_time(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` over an idle link."""
        return self.latency_s + nbytes * 8.0 / (self.bandwidth_gbps * 1e9)


@dataclass(slots=True)
class PhaseConfig:
    """One pool: its replicas' scheduler, cache and cost model, how many, how many GPUs
    each (for cost reports) and its router policy."""

    scheduler_config: SchedulerConfig
    cache_config: CacheConfig
    cost_model: CostModel
    num_replicas: int
    router_policy: str
    policy_options: dict[str, Any] = field(default_factory=dict)
    gpus_per_replica: int = 1

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas}")
        if self.cache_config.num_gpu_blocks is None:
            raise ValueError("cache_config.num_gpu_blocks must be set for a simulation")
        make_policy(self.router_policy, **self.policy_options)


@dataclass
class DisaggRun:
    """A P/D run: ``result`` holds the requests end to end (arrival, TTFT at the
    prefill's token, finish on the decode replica) in arrival order; the arrays below
    are per request (NaN where a phase never happened), the counters per request too."""

    result: SimResult
    prefill_start: np.ndarray
    prefill_done: np.ndarray
    transfer_start: np.ndarray
    transfer_end: np.ndarray
    decode_start: np.ndarray
    kv_bytes: np.ndarray
    num_prefilled: np.ndarray
    num_decoded: np.ndarray
    num_finished: np.ndarray
    # Prompt tokens decode replicas computed (0 unless they preempted by recompute).
    decode_prefill_tokens: int = 0
    prefill_replicas: list[dict] = field(default_factory=list)
    decode_replicas: list[dict] = field(default_factory=list)
    routed_prefill: dict[str, str] = field(default_factory=dict)
    routed_decode: dict[str, str] = field(default_factory=dict)


class DisaggSimulator:
    """A workload through ``prefill.num_replicas`` prefill engines, a KV link each, and
    ``decode.num_replicas`` decode engines."""

    def __init__(
        self,
        prefill: PhaseConfig,
        decode: PhaseConfig,
        *,
        kv_bytes_per_token: float,
        link: KVLink,
        stats_period_s: float = 0.0,
        record_itl: bool = True,
        vocab_size: int = 32000,
        label: str = "disaggregated",
    ) -> None:
        if not kv_bytes_per_token > 0:
            raise ValueError(f"kv_bytes_per_token must be > 0, got {kv_bytes_per_token}")
        if not stats_period_s >= 0:
            raise ValueError(f"stats_period_s must be >= 0, got {stats_period_s}")
        if prefill.cache_config.block_size != decode.cache_config.block_size:
            raise ValueError("prefill and decode replicas must share a block size")
        self.prefill, self.decode = prefill, decode
        self.kv_bytes_per_token = kv_bytes_per_token
        self.link = link
        self.stats_period_s = stats_period_s
        self.record_itl = record_itl
        self.vocab_size = vocab_size
        self.label = label
        self.prefill_reps: list[_Replica] = []
        self.decode_reps: list[_Replica] = []

    @property
    def num_gpus(self) -> int:
        p, d = self.prefill, self.decode
        return p.num_replicas * p.gpus_per_replica + d.num_replicas * d.gpus_per_replica

    def run(self, workload: Workload) -> DisaggRun:
        wall0 = time.perf_counter()
        specs = workload.requests
        n = len(specs)
        P, D = self.prefill, self.decode
        t0 = specs[0].arrival_time if n else 0.0
        preps = [_Replica(f"prefill-{k}", P.scheduler_config, P.cache_config, P.cost_model,
                          t0, False) for k in range(P.num_replicas)]
        dreps = [_Replica(f"decode-{k}", D.scheduler_config, D.cache_config, D.cost_model,
                          t0, self.record_itl) for k in range(D.num_replicas)]
        self.prefill_reps, self.decode_reps = preps, dreps
        ppol = make_policy(P.router_policy, **P.policy_options)
        dpol = make_policy(D.router_policy, **D.policy_options)
        by_id = {r.replica_id: r for r in (*preps, *dreps)}
        index = {r.replica_id: k for k, r in enumerate(preps)}
        pviews = [ReplicaView(r.replica_id) for r in preps]
        dviews = [ReplicaView(r.replica_id) for r in dreps]

        def poll(policy: RoutingPolicy, reps: list[_Replica], views: list[ReplicaView]) -> None:
            for k, r in enumerate(reps):
                st = r.snapshot()
                policy.update_stats(r.replica_id, st)
                views[k] = ReplicaView(r.replica_id, st.num_running, st.num_waiting)

        nan = math.nan
        rec = {k: np.full(n, nan) for k in (
            "prefill_start", "prefill_done", "transfer_start", "transfer_end",
            "decode_start", "finished", "kv_bytes")}
        num_out = np.zeros(n, dtype=np.int64)
        counts = {k: np.zeros(n, dtype=np.int64) for k in ("prefilled", "decoded", "finished")}
        routed_p: dict[str, str] = {}
        routed_d: dict[str, str] = {}
        views_of: dict[str, RequestView] = {}
        prefill_reqs: dict[str, Request] = {}
        decode_reqs: dict[str, Request] = {}
        link_free = [t0] * len(preps)
        events: list[tuple[float, int, int, str]] = []  # (time, seq, kind, rid)
        ROUTE, LAND = 0, 1  # a prefill finished: pick a decode replica; a transfer landed
        seq = 0
        num_rejected = 0
        decode_prefill_tokens = 0
        period = self.stats_period_s
        next_poll = t0 if period > 0 else math.inf
        num_polls = 0
        params: dict[int | None, SamplingParams] = {}
        one = SamplingParams(max_tokens=1, temperature=0.0)
        bs = P.cache_config.block_size
        hash_algo = P.cache_config.prefix_caching_hash_algo
        inf = math.inf
        i = 0

        def end(rid: str, t: float) -> None:
            k = int(rid)
            rec["finished"][k] = t
            counts["finished"][k] += 1

        while True:
            busy: _Replica | None = None
            t_step = inf
            for r in preps:
                if r.sched.requests and r.clock.t < t_step:
                    busy, t_step = r, r.clock.t
            for r in dreps:
                if r.sched.requests and r.clock.t < t_step:
                    busy, t_step = r, r.clock.t
            t_arr = specs[i].arrival_time if i < n else inf
            t_ev = events[0][0] if events else inf
            if busy is None and i >= n and not events:
                break
            if next_poll <= min(t_arr, t_ev, t_step):
                poll(ppol, preps, pviews)
                poll(dpol, dreps, dviews)
                num_polls += 1
                next_poll = t0 + num_polls * period
                continue
            if t_arr <= t_ev and t_arr <= t_step:
                spec = specs[i]
                rid = str(i)
                ids = prompt_token_ids(spec, i, self.vocab_size)
                view = RequestView.from_prompt(rid, ids, block_size=bs, hash_algo=hash_algo,
                                               session_key=spec.session_id)
                views_of[rid] = view
                if period == 0:
                    poll(ppol, preps, pviews)
                target = by_id[ppol.choose(view, pviews)]
                ppol.on_routed(view, target.replica_id)
                routed_p[rid] = target.replica_id
                req = Request(rid, ids, one, spec.arrival_time, eos_token_id=SIM_EOS_TOKEN_ID,
                              priority=spec.priority, tenant=spec.tenant)
                if not target.sched.requests:
                    target.clock.advance_to(t_arr)
                try:
                    target.engine.add_request(req)
                except ValueError:
                    num_rejected += 1
                    ppol.on_finished(view, target.replica_id)
                else:
                    target.executor.set_output_len(rid, spec.prompt_len, spec.output_len)
                    target.accepted.append(req)
                    prefill_reqs[rid] = req
                i += 1
                continue
            if t_ev <= t_step:
                t, _, kind, rid = heapq.heappop(events)
                k = int(rid)
                spec = specs[k]
                view = views_of[rid]
                if kind == ROUTE:
                    if period == 0:
                        poll(dpol, dreps, dviews)
                    dst = dpol.choose(view, dviews)
                    dpol.on_routed(view, dst)
                    routed_d[rid] = dst
                    src = index[routed_p[rid]]
                    nbytes = self.kv_bytes_per_token * spec.prompt_len
                    start = max(t, link_free[src])
                    land = start + self.link.transfer_time(nbytes)
                    link_free[src] = land
                    rec["transfer_start"][k], rec["transfer_end"][k] = start, land
                    rec["kv_bytes"][k] = nbytes
                    seq += 1
                    heapq.heappush(events, (land, seq, LAND, rid))
                    continue
                dst_rep = by_id[routed_d[rid]]
                sp = params.get(spec.max_tokens)
                if sp is None:
                    sp = params[spec.max_tokens] = SamplingParams(
                        max_tokens=spec.max_tokens, temperature=0.0)
                ids = prompt_token_ids(spec, k, self.vocab_size)
                dreq = Request(rid, ids, sp, t, eos_token_id=SIM_EOS_TOKEN_ID,
                               priority=spec.priority, tenant=spec.tenant)
                dreq.all_token_ids.append(SIM_TOKEN_ID)  # the prefill's token
                dreq.num_external_computed_tokens = spec.prompt_len
                if not dst_rep.sched.requests:
                    dst_rep.clock.advance_to(t)
                try:
                    dst_rep.engine.add_request(dreq)
                except ValueError:
                    num_rejected += 1
                    dpol.on_finished(view, dst_rep.replica_id)
                else:
                    dst_rep.executor.set_output_len(rid, spec.prompt_len, spec.output_len)
                    dst_rep.accepted.append(dreq)
                    decode_reqs[rid] = dreq
                    counts["decoded"][k] += 1
                continue
            assert busy is not None
            is_prefill = busy.replica_id.startswith("prefill")
            finished = _step(busy, min(t_arr, t_ev))
            if not is_prefill:
                decode_prefill_tokens += busy.sched.stats.num_prefill_tokens
            for rid in finished:
                k = int(rid)
                if is_prefill:
                    ppol.on_finished(views_of[rid], busy.replica_id)
                    req = prefill_reqs.pop(rid)
                    counts["prefilled"][k] += 1
                    rec["prefill_start"][k] = req.first_scheduled_time
                    done = float(req.finished_time)  # type: ignore[arg-type]
                    rec["prefill_done"][k] = done
                    num_out[k] = req.num_output_tokens
                    if req.all_token_ids[-1] == SIM_EOS_TOKEN_ID or specs[k].output_len <= 1:
                        end(rid, done)  # one token: nothing to decode
                    else:
                        seq += 1
                        heapq.heappush(events, (done, seq, ROUTE, rid))
                else:
                    dpol.on_finished(views_of[rid], busy.replica_id)
                    dreq = decode_reqs.pop(rid)
                    rec["decode_start"][k] = dreq.first_scheduled_time
                    num_out[k] = dreq.num_output_tokens
                    end(rid, float(dreq.finished_time))  # type: ignore[arg-type]
        wall = time.perf_counter() - wall0
        return self._result(specs, rec, num_out, counts, num_rejected, decode_prefill_tokens,
                            routed_p, routed_d, wall)

    def _result(self, specs: Any, rec: dict[str, np.ndarray], num_out: np.ndarray,
                counts: dict[str, np.ndarray], num_rejected: int, decode_prefill_tokens: int,
                routed_p: dict[str, str], routed_d: dict[str, str], wall: float) -> DisaggRun:
        preps, dreps = self.prefill_reps, self.decode_reps
        ok = ~np.isnan(rec["prefill_done"])  # accepted by a prefill replica
        parts = [build_result(r.replica_id, r.accepted, r.log, num_rejected=0,
                              num_preemptions_total=0, prefix_cache_queries=0,
                              prefix_cache_hits=0, wall_time_s=0.0, config={})
                 for r in (*preps, *dreps)]
        arrival = np.array([s.arrival_time for s in specs], dtype=np.float64)
        res = build_result(self.label, [], StepLog(), num_rejected=num_rejected,
                           num_preemptions_total=sum(r.sched.num_preemptions
                                                     for r in (*preps, *dreps)),
                           prefix_cache_queries=sum(r.sched.kv.prefix_cache_queries
                                                    for r in preps),
                           prefix_cache_hits=sum(r.sched.kv.prefix_cache_hits for r in preps),
                           wall_time_s=wall, config=self.describe())
        res.arrival = arrival[ok]
        res.first_scheduled = rec["prefill_start"][ok]
        res.first_token = rec["prefill_done"][ok]
        res.finished = rec["finished"][ok]
        res.prompt_len = np.array([s.prompt_len for s in specs], dtype=np.int64)[ok]
        res.output_len = num_out[ok]
        res.num_preemptions = np.zeros(int(ok.sum()), dtype=np.int64)
        order = np.argsort(np.concatenate([p.step_time for p in parts]), kind="stable")
        for name in ("step_time", "step_dt", "step_running", "step_waiting", "step_batch",
                     "step_tokens", "step_kv_usage"):
            setattr(res, name, np.concatenate([getattr(p, name) for p in parts])[order])
        res.itl = np.concatenate([p.itl for p in parts])
        res.replicas = [r.load().as_dict() for r in (*preps, *dreps)]
        sel = {k: v[ok] for k, v in rec.items()}
        return DisaggRun(
            res, sel["prefill_start"], sel["prefill_done"], sel["transfer_start"],
            sel["transfer_end"], sel["decode_start"], sel["kv_bytes"],
            counts["prefilled"], counts["decoded"], counts["finished"],
            decode_prefill_tokens=decode_prefill_tokens,
            prefill_replicas=[r.load().as_dict() for r in preps],
            decode_replicas=[r.load().as_dict() for r in dreps],
            routed_prefill=routed_p, routed_decode=routed_d,
        )

    def describe(self) -> dict[str, Any]:
        P, D = self.prefill, self.decode

        def pool(c: PhaseConfig) -> dict[str, Any]:
            return {"num_replicas": c.num_replicas, "gpus_per_replica": c.gpus_per_replica,
                    "router_policy": c.router_policy, "scheduler": c.scheduler_config.scheduler,
                    "max_num_seqs": c.scheduler_config.max_num_seqs,
                    "max_num_batched_tokens": c.scheduler_config.max_num_batched_tokens,
                    "num_gpu_blocks": c.cache_config.num_gpu_blocks,
                    "cost_model": c.cost_model.name}

        return {"disaggregated": True, "prefill": pool(P), "decode": pool(D),
                "kv_bytes_per_token": self.kv_bytes_per_token,
                "kv_link_gbps": self.link.bandwidth_gbps, "kv_link_latency_s": self.link.latency_s,
                "stats_period_s": self.stats_period_s, "num_gpus": self.num_gpus}


def _step(rep: _Replica, t_next: float) -> list[str]:
    """One step of ``rep`` (or, when nothing ran, a jump to its wake-up or ``t_next``);
    the ids it finished."""
    now = rep.clock.t
    outs = rep.engine.step()
    dt = rep.clock.t - now
    rep.log.record_step(now, dt, rep.sched.stats)
    if dt == 0.0:
        next_event = getattr(rep.sched, "next_event_time", None)
        wake = next_event(now) if next_event is not None else None
        nxt = wake if wake is not None and now < wake < t_next else t_next
        if nxt == math.inf or nxt <= now:
            raise RuntimeError(
                f"simulation stalled at t={now:.3f}s on {rep.replica_id}: "
                f"{len(rep.sched.requests)} unfinished requests but nothing scheduled")
        rep.clock.t = nxt
        return []
    if isinstance(outs, EngineCoreOutputs):
        token_rids, finished = outs.req_ids, outs.finished
    else:
        token_rids = [o.request_id for o in outs if o.new_token_ids]
        finished = {o.request_id: o for o in outs if o.finish_reason is not None}
    if rep.itl is not None:
        rep.itl.record(rep.clock.t, token_rids, finished)
    return list(finished)


def _phase_stats(values_s: np.ndarray) -> dict[str, float]:
    """Milliseconds, NaN (a phase that never happened) left out."""
    return latency_stats(values_s).as_dict()


def pd_metrics(run: DisaggRun, slos_ms: dict[str, float] | None = None) -> dict[str, Any]:
    """``compute_metrics`` of the end-to-end requests, and per phase: prefill (queue,
    time on the replica, TTFT), transfer (wait for the link, time on it, bytes) and
    decode (queue on the decode replica, its TPOT), with the SLOs met per phase."""
    r = run.result
    m = compute_metrics(r, slos_ms)
    lat = RequestLatencies.from_times(r.arrival, r.first_scheduled, r.first_token,
                                      r.finished, r.output_len)
    multi = r.output_len > 1
    decode_tpot = np.where(multi, (r.finished - run.transfer_end)
                           / np.maximum(r.output_len - 1, 1), np.nan)
    phases: dict[str, Any] = {
        "prefill": {
            "queue_ms": _phase_stats(run.prefill_start - r.arrival),
            "compute_ms": _phase_stats(run.prefill_done - run.prefill_start),
            "ttft_ms": _phase_stats(lat.ttft),
        },
        "transfer": {
            "num_transfers": int((~np.isnan(run.transfer_start)).sum()),
            "wait_ms": _phase_stats(run.transfer_start - run.prefill_done),
            "time_ms": _phase_stats(run.transfer_end - run.transfer_start),
            "total_ms": _phase_stats(run.transfer_end - run.prefill_done),
            "mean_bytes": float(np.nanmean(run.kv_bytes)) if multi.any() else 0.0,
        },
        "decode": {
            "queue_ms": _phase_stats(run.decode_start - run.transfer_end),
            "tpot_ms": _phase_stats(decode_tpot),
            "prefill_tokens_recomputed": run.decode_prefill_tokens,
        },
    }
    if slos_ms:
        n = max(len(r.arrival), 1)
        if "ttft" in slos_ms:
            phases["prefill"]["slo_fraction"] = float(
                meets_slos(lat, {"ttft": slos_ms["ttft"]}).sum()) / n
        if "tpot" in slos_ms:
            phases["decode"]["slo_fraction"] = float(
                meets_slos(lat, {"tpot": slos_ms["tpot"]}).sum()) / n
    m["phases"] = phases
    m["replicas"] = run.prefill_replicas + run.decode_replicas
    m["num_replicas"] = len(m["replicas"])
    if "busy_fraction" in m:
        m["busy_fraction"] /= max(len(m["replicas"]), 1)
    return m
