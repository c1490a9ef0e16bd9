"""The Ray Serve request router that routes engine requests through a routing policy.

Ray Serve builds one per deployment handle (in the ingress process), calls
``initialize_state`` with ``RequestRouterConfig.request_router_kwargs``, and for each
request ``choose_replicas`` (possibly several times while replicas are full), then
``on_request_routed`` and ``on_request_completed``. Replicas' ``record_routing_stats``
dicts arrive on ``RunningReplica.routing_stats`` (a poll period stale).

``choose_replicas`` returns the policy's ranking one replica per rank: Ray Serve picks
the least-queued replica *within* a rank, so a multi-replica rank would overrule the
policy; across ranks it takes the first replica that has room.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from iterserve.cluster import adapter as _adapter
from iterserve.cluster.adapter import PolicyAdapter, RoutingInfo


def routing_info(pending_request: PendingRequest | None) -> RoutingInfo | None:
    """The routing fields of an engine ``generate`` call (other calls have none)."""
    if pending_request is None:
        return None
    kwargs = pending_request.kwargs
    prompts = kwargs.get("prompts")
    if not prompts:
        return None
    return RoutingInfo(prompts[0], kwargs.get("cache_salt"), kwargs.get("session_key"))


class PolicyRequestRouter(RequestRouter):
    """Routes through ``iterserve.cluster`` policies (``PolicyAdapter``)."""

    adapter: PolicyAdapter

    def initialize_state(self, **kwargs: Any) -> None:
        self.adapter = PolicyAdapter(
            kwargs.get("policy", "cache_aware"),
            block_size=kwargs.get("block_size", 16),
            hash_algo=kwargs.get("hash_algo", "sha256"),
            policy_options=kwargs.get("policy_options"),
        )
        # Through the module: this class travels by value, the registry must not.
        _adapter.ROUTERS[kwargs.get("registry_key", "default")] = self

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        target = (pending_request.kwargs.get("target_replica")
                  if pending_request is not None else None)
        if target is not None:
            # A call for one replica (an abort): there while it lives; once it is gone
            # any replica answers it, as a no-op, rather than the call waiting forever.
            return [[by_id[target]]] if target in by_id else [candidate_replicas]
        key = (pending_request.metadata.internal_request_id
               if pending_request is not None else "")
        order = self.adapter.choose(
            key,
            routing_info(pending_request),
            [(rid, r.routing_stats) for rid, r in by_id.items()],
        )
        if pending_request is None:  # a probe for no request in particular
            self.adapter.completed(key)
        return [[by_id[rid]] for rid in order]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        self.adapter.routed(pending_request.metadata.internal_request_id, replica_id.unique_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.adapter.completed(internal_request_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.adapter.set_replicas(r.replica_id.unique_id for r in replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.adapter.remove_replica(replica_id.unique_id)

    # -- read by the ingress -----------------------------------------------------------

    def replica_reports(self) -> Mapping[str, Mapping[str, Any]]:
        """Each live replica's latest stats dict (with its rendered metrics)."""
        return {rid: r.routing_stats for rid, r in
                ((r.replica_id.unique_id, r) for r in self.curr_replicas.values())
                if r.routing_stats}
