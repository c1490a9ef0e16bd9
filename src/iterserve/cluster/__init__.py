"""Many replicas: routing policies as plain Python (no Ray import in this package).

``make_policy(name, **options)`` builds one of ``ROUTER_POLICIES``; see routing.py for
the interface and docs/cluster.md for the policies.
"""

from __future__ import annotations

from typing import Any

from iterserve.cluster.cache_aware import CacheAwarePolicy
from iterserve.cluster.routing import (
    LeastKVPolicy,
    LeastLoadedPolicy,
    PowerOfTwoPolicy,
    ReplicaStats,
    ReplicaView,
    RequestView,
    RoundRobinPolicy,
    RoutingPolicy,
)

_POLICIES: dict[str, type[RoutingPolicy]] = {
    "round_robin": RoundRobinPolicy,
    "least_loaded": LeastLoadedPolicy,
    "power_of_two": PowerOfTwoPolicy,
    "cache_aware": CacheAwarePolicy,
    "least_kv": LeastKVPolicy,
}
ROUTER_POLICIES = tuple(_POLICIES)


def make_policy(name: str, **options: Any) -> RoutingPolicy:
    """A fresh policy by name (``--router-policy``); options go to its constructor."""
    cls = _POLICIES.get(name)
    if cls is None:
        raise ValueError(f"router_policy must be one of {', '.join(ROUTER_POLICIES)}, "
                         f"got {name!r}")
    return cls(**options)


__all__ = [
    "ROUTER_POLICIES",
    "CacheAwarePolicy",
    "LeastKVPolicy",
    "LeastLoadedPolicy",
    "PowerOfTwoPolicy",
    "ReplicaStats",
    "ReplicaView",
    "RequestView",
    "RoundRobinPolicy",
    "RoutingPolicy",
    "make_policy",
]
