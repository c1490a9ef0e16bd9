"""Routing policies for N engine replicas, as plain Python (no Ray, no clock, no I/O).

One interface, used the same way by a Ray Serve request router, the multi-replica
simulator and tests:

- ``rank(request, replicas)``: the replicas' ids, best first (``choose`` takes the
  first). A caller that cannot use the first (full, dead) tries the next.
- ``on_routed(request, replica_id)`` once the request is sent there, and
  ``on_finished(request, replica_id)`` when it ends, however it ends.
- ``update_stats(replica_id, stats)`` with what a replica reports (its scheduler
  snapshot); ``remove_replica`` when one goes away.

A policy's view of a replica's load is ``max(reported running + waiting, requests it
routed there that have not finished)``: reports may be stale (a poll period), the
policy's own count is fresh for its own traffic, and a report also covers traffic
other routers sent. Ties are broken by the replica routed to longest ago, then by
position, so every policy is deterministic for a given call sequence (and a tie
between equally loaded replicas rotates among them, as round robin does).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from iterserve.core.block_hash import BlockHash, hash_prompt_blocks


@dataclass(slots=True)
class RequestView:
    """What a router knows of a request: the prompt's block-key chain (the very keys a
    replica's prefix cache uses, so salt and algorithm must match the replicas'), its
    length, and an optional session key (``X-Session-Id`` or ``user``)."""

    request_id: str
    num_prompt_tokens: int
    block_hashes: list[BlockHash] = field(default_factory=list)
    block_size: int = 16
    session_key: str | None = None

    @classmethod
    def from_prompt(
        cls,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        block_size: int = 16,
        hash_algo: str = "sha256",
        cache_salt: str | None = None,
        session_key: str | None = None,
    ) -> RequestView:
        return cls(
            request_id,
            len(prompt_token_ids),
            hash_prompt_blocks(prompt_token_ids, block_size, hash_algo=hash_algo,
                               cache_salt=cache_salt),
            block_size,
            session_key,
        )

    @property
    def max_cached_blocks(self) -> int:
        """Blocks a replica can serve from its cache: the block holding the last prompt
        token is always computed (the replica needs its logits)."""
        return max(self.num_prompt_tokens - 1, 0) // self.block_size


@dataclass(slots=True)
class ReplicaView:
    """A candidate replica and its load as the caller last heard it."""

    replica_id: str
    num_running: int = 0
    num_waiting: int = 0


@dataclass(slots=True)
class ReplicaStats:
    """A replica's report (its scheduler snapshot). Cache fields are optional: each one
    given corrects the cache-aware policy's guess of what the replica holds."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    # Device blocks: the most block keys the replica can hold.
    num_gpu_blocks: int | None = None
    # Blocks that hold a key right now (in use or evictable).
    num_cached_blocks: int | None = None
    # Keys evicted since the last report (a KV-event stream, when the replica sends one).
    removed_block_hashes: Sequence[BlockHash] = ()
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class RoutingPolicy:
    """Base: load and tie-break bookkeeping shared by every policy."""

    name = ""

    def __init__(self) -> None:
        self.outstanding: dict[str, int] = {}
        self.stats: dict[str, ReplicaStats] = {}
        self._last_routed: dict[str, int] = {}
        self._seq = 0

    # -- the interface -------------------------------------------------------------

    def rank(self, request: RequestView, replicas: Sequence[ReplicaView]) -> list[str]:
        raise NotImplementedError

    def choose(self, request: RequestView, replicas: Sequence[ReplicaView]) -> str:
        if not replicas:
            raise ValueError("replicas must not be empty: no replica to route to")
        return self.rank(request, replicas)[0]

    def on_routed(self, request: RequestView, replica_id: str) -> None:
        self.outstanding[replica_id] = self.outstanding.get(replica_id, 0) + 1
        self._seq += 1
        self._last_routed[replica_id] = self._seq

    def on_finished(self, request: RequestView, replica_id: str) -> None:
        n = self.outstanding.get(replica_id, 0)
        if n > 0:
            self.outstanding[replica_id] = n - 1

    def update_stats(self, replica_id: str, stats: ReplicaStats) -> None:
        self.stats[replica_id] = stats

    def remove_replica(self, replica_id: str) -> None:
        self.outstanding.pop(replica_id, None)
        self.stats.pop(replica_id, None)
        self._last_routed.pop(replica_id, None)

    # -- helpers -------------------------------------------------------------------

    def load(self, replica: ReplicaView) -> int:
        reported = replica.num_running + replica.num_waiting
        return max(reported, self.outstanding.get(replica.replica_id, 0))

    def _tie(self, replica: ReplicaView, position: int) -> tuple[int, int]:
        """Least recently routed first, then the caller's order."""
        return self._last_routed.get(replica.replica_id, 0), position

    def _by_load(self, replicas: Sequence[ReplicaView]) -> list[str]:
        keyed = sorted(
            (self.load(r), *self._tie(r, i), r.replica_id) for i, r in enumerate(replicas)
        )
        return [k[-1] for k in keyed]


class RoundRobinPolicy(RoutingPolicy):
    """Each replica in turn: the one routed to longest ago first."""

    name = "round_robin"

    def rank(self, request: RequestView, replicas: Sequence[ReplicaView]) -> list[str]:
        keyed = sorted((*self._tie(r, i), r.replica_id) for i, r in enumerate(replicas))
        return [k[-1] for k in keyed]


class LeastLoadedPolicy(RoutingPolicy):
    """Fewest running + waiting requests (vLLM's data-parallel balancer scores
    ``running + 4 * waiting``: set ``waiting_weight=4`` for that)."""

    name = "least_loaded"

    def __init__(self, waiting_weight: float = 1.0) -> None:
        super().__init__()
        if waiting_weight < 0:
            raise ValueError(f"waiting_weight must be >= 0, got {waiting_weight}")
        self.waiting_weight = waiting_weight

    def _score(self, r: ReplicaView) -> float:
        weighted = r.num_running + self.waiting_weight * r.num_waiting
        return max(weighted, float(self.outstanding.get(r.replica_id, 0)))

    def rank(self, request: RequestView, replicas: Sequence[ReplicaView]) -> list[str]:
        keyed = sorted(
            (self._score(r), *self._tie(r, i), r.replica_id) for i, r in enumerate(replicas)
        )
        return [k[-1] for k in keyed]


class PowerOfTwoPolicy(RoutingPolicy):
    """Two replicas drawn at random (seeded), the less loaded first; then the rest by
    load. Spreads like least-loaded without every router herding to one replica."""

    name = "power_of_two"

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.rng = random.Random(seed)

    def rank(self, request: RequestView, replicas: Sequence[ReplicaView]) -> list[str]:
        if len(replicas) <= 2:
            return self._by_load(replicas)
        picked = self.rng.sample(range(len(replicas)), 2)
        first = self._by_load([replicas[i] for i in sorted(picked)])
        rest = self._by_load([r for i, r in enumerate(replicas) if i not in picked])
        return first + rest


class LeastKVPolicy(RoutingPolicy):
    """Least KV in use: for decode replicas of a prefill/decode split, whose step time
    grows with the KV they read and whose capacity is their KV cache, not a request
    count. A replica's KV is ``max(reported usage x its blocks, prompt blocks this
    policy routed there and not finished)``, then the request count breaks ties; a
    replica that reported no capacity counts only the routed blocks."""

    name = "least_kv"

    def __init__(self) -> None:
        super().__init__()
        self.outstanding_blocks: dict[str, int] = {}

    def on_routed(self, request: RequestView, replica_id: str) -> None:
        super().on_routed(request, replica_id)
        t = self.outstanding_blocks
        t[replica_id] = t.get(replica_id, 0) + self._blocks(request)

    def on_finished(self, request: RequestView, replica_id: str) -> None:
        super().on_finished(request, replica_id)
        t = self.outstanding_blocks
        t[replica_id] = max(t.get(replica_id, 0) - self._blocks(request), 0)

    def remove_replica(self, replica_id: str) -> None:
        super().remove_replica(replica_id)
        self.outstanding_blocks.pop(replica_id, None)

    @staticmethod
    def _blocks(request: RequestView) -> int:
        return -(-request.num_prompt_tokens // request.block_size)

    def kv_blocks(self, replica_id: str) -> float:
        """The replica's KV in use, in blocks, as this policy sees it."""
        st = self.stats.get(replica_id)
        reported = st.kv_cache_usage * st.num_gpu_blocks if st and st.num_gpu_blocks else 0.0
        return max(reported, float(self.outstanding_blocks.get(replica_id, 0)))

    def rank(self, request: RequestView, replicas: Sequence[ReplicaView]) -> list[str]:
        keyed = sorted(
            (self.kv_blocks(r.replica_id), self.load(r), *self._tie(r, i), r.replica_id)
            for i, r in enumerate(replicas)
        )
        return [k[-1] for k in keyed]
