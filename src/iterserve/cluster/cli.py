"""The ``iterserve serve`` flags of the Ray Serve cluster (no Ray import here: a
single-replica server never loads Ray)."""

from __future__ import annotations

import argparse

from iterserve.cluster import ROUTER_POLICIES


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster (Ray Serve)")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine replicas; above 1 they run on Ray Serve behind a routing "
                   "policy, the HTTP server in this process (vLLM's flag)")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (default: start a local Ray instance)")
    g.add_argument("--router-policy", default="cache_aware", choices=ROUTER_POLICIES,
                   help="how requests are spread over replicas (docs/cluster.md)")


def check_cluster_args(args: argparse.Namespace) -> None:
    if args.data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {args.data_parallel_size}")
