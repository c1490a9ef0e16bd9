"""The glue between a routing policy and a request router that knows replicas only by
id and by the stats dict each one reports (Ray Serve's ``routing_stats``); plain Python,
so it is tested with fake replicas and reused by any router shell.

A request is known by a key (Ray Serve's internal request id): ``choose`` may run
several times for one request (the router retries while replicas are full), so the
request's ``RequestView`` (its block-key chain, hashed once) is kept under that key
until the request completes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from iterserve.cluster import make_policy
from iterserve.cluster.routing import ReplicaStats, ReplicaView, RequestView, RoutingPolicy

# The keys of a replica's stats dict (``record_routing_stats``) that ReplicaStats reads.
STATS_FIELDS = (
    "num_running",
    "num_waiting",
    "kv_cache_usage",
    "num_gpu_blocks",
    "num_cached_blocks",
    "prefix_cache_queries",
    "prefix_cache_hits",
)


def stats_from_dict(d: Mapping[str, Any]) -> ReplicaStats:
    """A replica's report as the policy reads it; unknown keys are ignored (the dict
    also carries the replica's rendered metrics)."""
    return ReplicaStats(**{k: d[k] for k in STATS_FIELDS if k in d})


@dataclass(slots=True)
class RoutingInfo:
    """What the router needs of a request: its first prompt (the one whose prefix the
    replica caches first), the effective cache salt and an optional session key."""

    prompt_token_ids: Sequence[int] = ()
    cache_salt: str | None = None
    session_key: str | None = None


# The request routers living in this process, by the key their router kwargs give: the
# ingress reads routing counts and replicas' reports through its router. (Here, not in
# ray_router.py: Ray Serve ships a router class by value, with copies of its module's
# globals; this module is imported by reference, so the registry is the process's.)
ROUTERS: dict[str, Any] = {}

# Requests tracked at once: one chosen but never routed nor completed (cancelled while
# the router waited for room) would otherwise stay forever.
MAX_TRACKED_REQUESTS = 1 << 16


class PolicyAdapter:
    """Ranks replica ids for requests through a policy, keeping its bookkeeping
    (routed, finished, stats, replicas gone) in step with the router's events."""

    def __init__(
        self,
        policy: str | RoutingPolicy = "cache_aware",
        *,
        block_size: int = 16,
        hash_algo: str = "sha256",
        policy_options: Mapping[str, Any] | None = None,
    ) -> None:
        if isinstance(policy, str):
            policy = make_policy(policy, **dict(policy_options or {}))
        self.policy = policy
        self.block_size = block_size
        self.hash_algo = hash_algo
        # request key -> its view, from its first ``choose`` until it completes.
        self.requests: dict[str, RequestView] = {}
        # request key -> the replica it was routed to.
        self.routed_to: dict[str, str] = {}
        # replica id -> the last stats dict applied (reports repeat between polls).
        self.reports: dict[str, Mapping[str, Any]] = {}
        self.num_routed: dict[str, int] = {}

    def view(self, key: str, info: RoutingInfo | None) -> RequestView:
        view = self.requests.get(key)
        if view is None:
            if len(self.requests) >= MAX_TRACKED_REQUESTS:
                self._forget_oldest_unrouted()
            info = info or RoutingInfo()
            view = RequestView.from_prompt(
                key, info.prompt_token_ids, block_size=self.block_size,
                hash_algo=self.hash_algo, cache_salt=info.cache_salt,
                session_key=info.session_key,
            )
            self.requests[key] = view
        return view

    def observe(self, replica_id: str, report: Mapping[str, Any] | None) -> None:
        """Apply a replica's stats dict, once per new report."""
        if not report or self.reports.get(replica_id) is report:
            return
        self.reports[replica_id] = report
        self.policy.update_stats(replica_id, stats_from_dict(report))

    def choose(
        self,
        key: str,
        info: RoutingInfo | None,
        candidates: Sequence[tuple[str, Mapping[str, Any] | None]],
    ) -> list[str]:
        """Replica ids best first, for ``(replica id, latest stats dict)`` candidates."""
        views = []
        for replica_id, report in candidates:
            self.observe(replica_id, report)
            stats = self.policy.stats.get(replica_id)
            views.append(ReplicaView(
                replica_id,
                stats.num_running if stats else 0,
                stats.num_waiting if stats else 0,
            ))
        if not views:
            return []
        view = self.view(key, info)
        self._unroute(key)  # a retry: its earlier pick did not take it
        order = self.policy.rank(view, views)
        # Counted as routed to the first choice now, not when the router confirms: Ray
        # Serve confirms after a round trip to the replica, and requests chosen in the
        # meantime must see this one's load and blocks. ``routed`` corrects the guess.
        self._route(key, view, order[0])
        return order

    def routed(self, key: str, replica_id: str) -> None:
        """The router sent the request to ``replica_id`` (confirming or correcting the
        first choice)."""
        view = self.requests.get(key)
        if view is None or self.routed_to.get(key) == replica_id:
            return
        self._unroute(key)
        self._route(key, view, replica_id)

    def _route(self, key: str, view: RequestView, replica_id: str) -> None:
        self.routed_to[key] = replica_id
        self.num_routed[replica_id] = self.num_routed.get(replica_id, 0) + 1
        self.policy.on_routed(view, replica_id)

    def _unroute(self, key: str) -> None:
        replica_id = self.routed_to.pop(key, None)
        if replica_id is not None:
            self.num_routed[replica_id] -= 1
            self.policy.on_finished(self.requests[key], replica_id)

    def completed(self, key: str) -> None:
        view = self.requests.pop(key, None)
        replica_id = self.routed_to.pop(key, None)
        if view is not None and replica_id is not None:
            self.policy.on_finished(view, replica_id)

    def _forget_oldest_unrouted(self) -> None:
        for key in list(self.requests)[: max(len(self.requests) // 8, 1)]:
            if key not in self.routed_to:
                del self.requests[key]

    def remove_replica(self, replica_id: str) -> None:
        self.reports.pop(replica_id, None)
        self.policy.remove_replica(replica_id)
        for key in [k for k, r in self.routed_to.items() if r == replica_id]:
            del self.routed_to[key]
            self.requests.pop(key, None)

    def set_replicas(self, replica_ids: Iterable[str]) -> None:
        """The live replicas now: forget the others."""
        live = set(replica_ids)
        gone = (set(self.reports) | set(self.policy.outstanding)) - live
        for replica_id in gone:
            self.remove_replica(replica_id)
