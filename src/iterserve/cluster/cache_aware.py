"""Prefix-cache-aware routing: send a request where its prefix probably is, unless
that would pile load onto one replica.

Per replica the policy keeps an LRU set of the block keys it probably holds: a
request's keys are added when it is routed there, and the set is corrected from the
replica's reports (its capacity in blocks, how many keyed blocks it holds now, keys
it evicted). Keys are the replicas' own (core/block_hash.py), so a prefix match
here is a prediction of the replica's prefix-cache hit.

The decision, per request:

1. Load-imbalance gate (sgl-router's): if ``max_load - min_load >
   balance_abs_threshold`` and ``max_load > balance_rel_threshold * min_load``, rank
   by load alone: a hot prefix must not pin everything to one replica.
2. Otherwise rank by ``uncached prefill tokens + load_weight * load``: the tokens
   the replica would have to compute, plus what its queue costs, in tokens per
   request. Ties: fewer load, then least recently routed, then position.
3. Session affinity (optional): a request whose session (``X-Session-Id`` or
   ``user``) was routed before goes back to that replica while the gate is closed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from iterserve.cluster.routing import (
    ReplicaStats,
    ReplicaView,
    RequestView,
    RoutingPolicy,
)
from iterserve.core.block_hash import BlockHash


class CacheAwarePolicy(RoutingPolicy):
    name = "cache_aware"

    def __init__(
        self,
        *,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.1,
        load_weight: float = 64.0,
        max_blocks_per_replica: int = 1 << 16,
        session_affinity: bool = True,
        max_sessions: int = 1 << 16,
    ) -> None:
        super().__init__()
        if balance_abs_threshold < 0:
            raise ValueError(f"balance_abs_threshold must be >= 0, got {balance_abs_threshold}")
        if balance_rel_threshold < 1.0:
            raise ValueError(
                f"balance_rel_threshold must be >= 1, got {balance_rel_threshold}"
            )
        if load_weight < 0:
            raise ValueError(f"load_weight must be >= 0, got {load_weight}")
        if max_blocks_per_replica <= 0:
            raise ValueError(
                f"max_blocks_per_replica must be positive, got {max_blocks_per_replica}"
            )
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.load_weight = load_weight
        self.max_blocks_per_replica = max_blocks_per_replica
        self.session_affinity = session_affinity
        self.max_sessions = max_sessions
        # replica -> block keys it probably holds, least recently used first.
        self.blocks: dict[str, OrderedDict[BlockHash, None]] = {}
        self.capacity: dict[str, int] = {}
        # session key -> the replica its last request went to (LRU-bounded).
        self.sessions: OrderedDict[str, str] = OrderedDict()

    # -- prediction ------------------------------------------------------------------

    def matched_blocks(self, request: RequestView, replica_id: str) -> int:
        """Leading blocks of the request's prefix the replica probably holds."""
        held = self.blocks.get(replica_id)
        if not held:
            return 0
        n = 0
        for h in request.block_hashes[: request.max_cached_blocks]:
            if h not in held:
                break
            n += 1
        return n

    def uncached_tokens(self, request: RequestView, replica_id: str) -> int:
        return request.num_prompt_tokens - self.matched_blocks(request, replica_id) * (
            request.block_size
        )

    def is_imbalanced(self, loads: Sequence[int]) -> bool:
        if len(loads) < 2:
            return False
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo

    # -- the interface -----------------------------------------------------------------

    def rank(self, request: RequestView, replicas: Sequence[ReplicaView]) -> list[str]:
        loads = [self.load(r) for r in replicas]
        if self.is_imbalanced(loads):
            return self._by_load(replicas)
        keyed = sorted(
            (
                self.uncached_tokens(request, r.replica_id) + self.load_weight * loads[i],
                loads[i],
                *self._tie(r, i),
                r.replica_id,
            )
            for i, r in enumerate(replicas)
        )
        order = [k[-1] for k in keyed]
        sticky = self._sticky(request)
        if sticky is not None and sticky in order and sticky != order[0]:
            order.remove(sticky)
            order.insert(0, sticky)
        return order

    def on_routed(self, request: RequestView, replica_id: str) -> None:
        super().on_routed(request, replica_id)
        held = self.blocks.setdefault(replica_id, OrderedDict())
        # Tail first, so a prefix's head is the most recent: replicas evict a request's
        # tail before its head, and a match stops at the first missing block.
        for h in reversed(request.block_hashes):
            if h in held:
                held.move_to_end(h)
            else:
                held[h] = None
        self._trim(replica_id, self.capacity.get(replica_id, self.max_blocks_per_replica))
        if self.session_affinity and request.session_key is not None:
            self.sessions[request.session_key] = replica_id
            self.sessions.move_to_end(request.session_key)
            while len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)

    def update_stats(self, replica_id: str, stats: ReplicaStats) -> None:
        super().update_stats(replica_id, stats)
        held = self.blocks.get(replica_id)
        if stats.num_gpu_blocks is not None:
            self.capacity[replica_id] = stats.num_gpu_blocks
        if held is None:
            return
        for h in stats.removed_block_hashes:
            held.pop(h, None)
        limit = self.capacity.get(replica_id, self.max_blocks_per_replica)
        if stats.num_cached_blocks is not None:
            # It holds fewer keyed blocks than we guessed: the oldest are the ones gone.
            limit = min(limit, stats.num_cached_blocks)
        self._trim(replica_id, limit)

    def remove_replica(self, replica_id: str) -> None:
        super().remove_replica(replica_id)
        self.blocks.pop(replica_id, None)
        self.capacity.pop(replica_id, None)
        for key in [k for k, v in self.sessions.items() if v == replica_id]:
            del self.sessions[key]

    # -- internals -------------------------------------------------------------------

    def _sticky(self, request: RequestView) -> str | None:
        if not self.session_affinity or request.session_key is None:
            return None
        return self.sessions.get(request.session_key)

    def _trim(self, replica_id: str, limit: int) -> None:
        held = self.blocks.get(replica_id)
        if held is None:
            return
        while len(held) > max(limit, 0):
            held.popitem(last=False)
