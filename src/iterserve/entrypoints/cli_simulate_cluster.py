"""`iterserve simulate --num-replicas N --router-policy P[,P...]`: the cluster runs of
``simulate`` (sim/cluster.py), one column per routing policy (and scheduler / policy
when those are lists too), with a per-replica load table."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from iterserve.config import CacheConfig, SchedulerConfig


def run_cluster(
    args: argparse.Namespace,
    wl: Any,
    runs: list[tuple[str, str]],
    configs: Callable[[str, str], tuple[SchedulerConfig, CacheConfig]],
    cost: Any,
    goodput: dict[str, float],
    check: Any,
    out_dir: Path | None,
    engine_args: dict[str, Any],
) -> int:
    from iterserve.sim import report
    from iterserve.sim.cluster import ClusterSimulator, cluster_metrics, format_replica_table

    if args.sweep:
        raise SystemExit("error: --sweep runs one engine; drop it or --num-replicas")
    if args.compare_with:
        raise SystemExit("error: --compare-with compares one engine; drop it or --num-replicas")
    routers = [p.strip() for p in args.router_policy.split(",") if p.strip()]
    if not routers:
        raise SystemExit("error: --router-policy needs at least one policy")
    many = len(runs) > 1
    results = []
    for sched, pol in runs:
        sc, cc = configs(sched, pol)
        for router in routers:
            label = router if not many else f"{router}/{sched}/{pol}"
            try:
                sim = ClusterSimulator(sc, cc, cost, num_replicas=args.num_replicas,
                                       router_policy=router,
                                       stats_period_s=args.router_stats_period, label=label)
            except ValueError as e:
                raise SystemExit(f"error: {e}") from None
            if not args.no_progress:
                print(f"simulating {label} on {args.num_replicas} replicas ...", file=sys.stderr)
            res = sim.run(wl)
            res.stability = check
            res.metrics = cluster_metrics(res, goodput)
            results.append(res)
    columns = [(r.label, r.metrics) for r in results]
    title = f"Simulation: {wl.name} on {args.num_replicas} replicas"
    report.print_table(columns, title=title, rich=not args.plain and sys.stdout.isatty())
    print("\nPer-replica load:\n" + format_replica_table(columns))
    if out_dir:
        extra = {"workload": {"description": wl.describe(), **wl.meta},
                 "stability": check.message(), "engine_args": engine_args,
                 "cluster": {"num_replicas": args.num_replicas, "router_policies": routers,
                             "stats_period_s": args.router_stats_period}}
        path = report.save_json(out_dir / "result.json", results, extra,
                                with_records=args.save_records)
        written = [str(path)]
        if not args.no_plots:
            written.append(str(report.plot_cdfs(results, out_dir / "latency_cdf.png")))
        print("wrote " + ", ".join(written))
    return 0
