"""Fleet planning: the cheapest deployment that serves a workload within its SLOs.

A ``Deployment`` is colocated (N replicas of one GPU kind, each on TP GPUs, behind the
router) or disaggregated (P prefill replicas of one kind and TP, D decode replicas of
another or the same, a KV link per prefill replica). Its price is its GPU count times
each kind's ``price_per_hour`` (hardware.py: planning assumptions, documented in
docs/simulator.md), its power the GPUs' board power.

``plan`` searches each family (mode, GPU kinds, TP sizes) in order of price and keeps
the first deployment whose goodput fraction (requests within every SLO) reaches the
target at the given rate: the family's cheapest; the cheapest of those is the plan.
Every candidate runs the production scheduler and router objects through
``ClusterSimulator`` / ``DisaggSimulator``; nothing here is a closed-form estimate.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from iterserve.config import CacheConfig, SchedulerConfig
from iterserve.sim.cluster import ClusterSimulator, cluster_metrics
from iterserve.sim.cost_model import CostModel
from iterserve.sim.disagg import DisaggSimulator, KVLink, PhaseConfig, pd_metrics
from iterserve.sim.hardware import get_hardware
from iterserve.sim.workload import Workload

# (hardware name, tensor parallel size) -> the pool's cost model and resolved configs.
PoolFactory = Callable[[str, int], tuple[CostModel, SchedulerConfig, CacheConfig]]

COLOCATED, DISAGGREGATED = "colocated", "disaggregated"


@dataclass(frozen=True, slots=True)
class Deployment:
    """One candidate fleet. Colocated: ``num_prefill`` is the replica count and the
    decode fields are unused (0 / "")."""

    mode: str
    prefill_hardware: str
    prefill_tp: int
    num_prefill: int
    decode_hardware: str = ""
    decode_tp: int = 0
    num_decode: int = 0

    @classmethod
    def colocated(cls, hardware: str, tp: int, n: int) -> Deployment:
        return cls(COLOCATED, hardware, tp, n)

    @classmethod
    def disaggregated(cls, ph: str, ptp: int, p: int, dh: str, dtp: int, d: int) -> Deployment:
        return cls(DISAGGREGATED, ph, ptp, p, dh, dtp, d)

    @property
    def is_disaggregated(self) -> bool:
        return self.mode == DISAGGREGATED

    @property
    def num_gpus(self) -> int:
        return self.num_prefill * self.prefill_tp + self.num_decode * self.decode_tp

    def _sum(self, attr: str) -> float:
        total = self.num_prefill * self.prefill_tp * getattr(get_hardware(self.prefill_hardware), attr)
        if self.is_disaggregated:
            total += self.num_decode * self.decode_tp * getattr(
                get_hardware(self.decode_hardware), attr)
        return float(total)

    @property
    def price_per_hour(self) -> float:
        """USD per hour at the presets' per-GPU prices."""
        return self._sum("price_per_hour")

    @property
    def power_w(self) -> float:
        return self._sum("power_w")

    @property
    def family(self) -> str:
        if not self.is_disaggregated:
            return f"colocated {self.prefill_hardware}x{self.prefill_tp}"
        return (f"P/D {self.prefill_hardware}x{self.prefill_tp} : "
                f"{self.decode_hardware}x{self.decode_tp}")

    @property
    def label(self) -> str:
        if not self.is_disaggregated:
            return f"{self.num_prefill} x {self.prefill_hardware}x{self.prefill_tp}"
        return (f"{self.num_prefill}P {self.prefill_hardware}x{self.prefill_tp} + "
                f"{self.num_decode}D {self.decode_hardware}x{self.decode_tp}")


@dataclass(slots=True)
class Evaluation:
    deployment: Deployment
    rate: float
    metrics: dict[str, Any]

    @property
    def goodput_fraction(self) -> float:
        return float(self.metrics.get("goodput", {}).get("fraction", 0.0))

    @property
    def goodput_rps(self) -> float:
        return float(self.metrics.get("goodput", {}).get("requests_per_s", 0.0))


@dataclass(slots=True)
class PlanResult:
    rate: float
    target: float
    slos_ms: dict[str, float]
    # Per family: its cheapest deployment meeting the target (None: none within the
    # GPU limit), and every evaluation made.
    best: dict[str, Evaluation | None] = field(default_factory=dict)
    evaluated: list[Evaluation] = field(default_factory=list)

    @property
    def cheapest(self) -> Evaluation | None:
        ok = [e for e in self.best.values() if e is not None]
        return min(ok, key=lambda e: (e.deployment.price_per_hour, -e.goodput_fraction),
                   default=None)


@dataclass(slots=True)
class Planner:
    """Runs deployments on a workload: ``pools`` builds each pool's cost model and
    configs; ``kv_bytes_per_token`` and ``link`` price the transfers; the routers are
    the real cluster's."""

    pools: PoolFactory
    kv_bytes_per_token: float
    link: KVLink
    slos_ms: dict[str, float]
    router_policy: str = "cache_aware"
    decode_router_policy: str = "least_kv"
    stats_period_s: float = 0.0
    _cache: dict[tuple[str, int], tuple[CostModel, SchedulerConfig, CacheConfig]] = field(
        default_factory=dict)

    def pool(self, hardware: str, tp: int) -> tuple[CostModel, SchedulerConfig, CacheConfig]:
        key = (hardware, tp)
        if key not in self._cache:
            self._cache[key] = self.pools(hardware, tp)
        return self._cache[key]

    def fits(self, hardware: str, tp: int) -> bool:
        try:
            self.pool(hardware, tp)
        except ValueError:
            return False
        return True

    def hopeless(self, dep: Deployment) -> bool:
        """No replica count can meet the SLOs: one lone decode step (the floor of TPOT)
        on the decode GPUs, or the prefill of one token (the floor of TTFT), already
        exceeds it."""
        cost = self.pool(dep.decode_hardware or dep.prefill_hardware,
                         dep.decode_tp or dep.prefill_tp)[0]
        tpot = self.slos_ms.get("tpot")
        if tpot is not None and cost.time_for(num_decode_seqs=1, num_context_tokens=1) * 1e3 > tpot:
            return True
        pcost = self.pool(dep.prefill_hardware, dep.prefill_tp)[0]
        ttft = self.slos_ms.get("ttft")
        return ttft is not None and pcost.time_for(num_prefill_tokens=1) * 1e3 > ttft

    def evaluate(self, dep: Deployment, workload: Workload, rate: float) -> Evaluation:
        cost, sc, cc = self.pool(dep.prefill_hardware, dep.prefill_tp)
        if not dep.is_disaggregated:
            sim = ClusterSimulator(sc, cc, cost, num_replicas=dep.num_prefill,
                                   router_policy=self.router_policy,
                                   stats_period_s=self.stats_period_s, record_itl=False,
                                   label=dep.label)
            m = cluster_metrics(sim.run(workload), self.slos_ms)
        else:
            dcost, dsc, dcc = self.pool(dep.decode_hardware, dep.decode_tp)
            sim_pd = DisaggSimulator(
                PhaseConfig(sc, cc, cost, dep.num_prefill, self.router_policy,
                            gpus_per_replica=dep.prefill_tp),
                PhaseConfig(dsc, dcc, dcost, dep.num_decode, self.decode_router_policy,
                            gpus_per_replica=dep.decode_tp),
                kv_bytes_per_token=self.kv_bytes_per_token, link=self.link,
                stats_period_s=self.stats_period_s, record_itl=False, label=dep.label)
            m = pd_metrics(sim_pd.run(workload), self.slos_ms)
        return Evaluation(dep, rate, m)


def candidates(hardware: Sequence[str], tp_sizes: Mapping[str, Sequence[int]], max_gpus: int,
               modes: Sequence[str] = (COLOCATED, DISAGGREGATED),
               fits: Callable[[str, int], bool] | None = None) -> dict[str, list[Deployment]]:
    """Every deployment within ``max_gpus``, grouped by family, each group by price
    (then GPUs, then more decode replicas first)."""
    kinds = [(h, tp) for h in hardware for tp in tp_sizes.get(h, [1])
             if fits is None or fits(h, tp)]
    fams: dict[str, list[Deployment]] = {}
    if COLOCATED in modes:
        for h, tp in kinds:
            deps = [Deployment.colocated(h, tp, n) for n in range(1, max_gpus // tp + 1)]
            if deps:
                fams[deps[0].family] = deps
    if DISAGGREGATED in modes:
        for (ph, ptp), (dh, dtp) in itertools.product(kinds, kinds):
            deps = [Deployment.disaggregated(ph, ptp, p, dh, dtp, d)
                    for p in range(1, max_gpus // ptp + 1)
                    for d in range(1, (max_gpus - p * ptp) // dtp + 1)]
            if deps:
                fams[deps[0].family] = deps
    for deps in fams.values():
        deps.sort(key=lambda d: (d.price_per_hour, d.num_gpus, -d.num_decode))
    return fams


def plan(planner: Planner, workload: Workload, rate: float, *, hardware: Sequence[str],
         tp_sizes: Mapping[str, Sequence[int]], max_gpus: int, target: float = 0.9,
         modes: Sequence[str] = (COLOCATED, DISAGGREGATED),
         progress: Callable[[Evaluation], None] | None = None) -> PlanResult:
    """The cheapest deployment per family meeting ``target`` goodput at ``rate``.

    Within a family deployments are tried by price; one that is no bigger in both
    pools than one already seen to miss the target is skipped (goodput does not rise
    when replicas are taken away), and a family whose GPUs cannot meet the SLOs even
    unloaded (``Planner.hopeless``) is not tried."""
    if not 0 < target <= 1:
        raise ValueError(f"goodput target must be in (0, 1], got {target}")
    if max_gpus < 1:
        raise ValueError(f"max_gpus must be >= 1, got {max_gpus}")
    res = PlanResult(rate, target, dict(planner.slos_ms))
    for fam, deps in candidates(hardware, tp_sizes, max_gpus, modes, planner.fits).items():
        res.best[fam] = None
        if planner.hopeless(deps[0]):
            continue
        failed: list[Deployment] = []
        for dep in deps:
            if any(dep.num_prefill <= f.num_prefill and dep.num_decode <= f.num_decode
                   for f in failed):
                continue
            ev = planner.evaluate(dep, workload, rate)
            res.evaluated.append(ev)
            if progress is not None:
                progress(ev)
            if ev.goodput_fraction >= target:
                res.best[fam] = ev
                break
            failed.append(dep)
    return res


def max_rate(planner: Planner, dep: Deployment, workload_at: Callable[[float], Workload],
             target: float, lo: float, hi: float, iters: int = 7) -> tuple[float, Evaluation | None]:
    """The highest rate in [lo, hi] at which ``dep`` still meets ``target`` (bisection;
    goodput fraction falls with load): its throughput within the SLOs. (0, None) when
    even ``lo`` misses."""
    best: Evaluation | None = None
    ev = planner.evaluate(dep, workload_at(lo), lo)
    if ev.goodput_fraction < target:
        return 0.0, None
    best = ev
    ev = planner.evaluate(dep, workload_at(hi), hi)
    if ev.goodput_fraction >= target:
        return hi, ev
    for _ in range(iters):
        mid = (lo + hi) / 2
        ev = planner.evaluate(dep, workload_at(mid), mid)
        if ev.goodput_fraction >= target:
            lo, best = mid, ev
        else:
            hi = mid
    return lo, best
