"""The device's KV blocks: ref counts, a free queue in eviction order, a hash -> block map.

Invariant: a block is in the free queue iff its ref count is 0. A freed block
keeps its hash (stays findable by prefix lookups) until it is taken for reuse,
so "free" includes "cached but evictable".
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from iterserve.core.block_hash import BlockHash


class KVCacheBlock:
    __slots__ = ("block_hash", "block_id", "num_queued", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        # Entries of this block in the free queue: the last is live while the block is
        # free, the others are stale (see BlockPool).
        self.num_queued = 0

    def __repr__(self) -> str:
        h = None if self.block_hash is None else self.block_hash.hex()[:12]
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hash={h})"


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` token slots.

    Eviction order of the free queue (front is evicted first):
    blocks with no hash (nothing to reuse) go to the front; cached blocks go to
    the back in the order they are freed. A request frees its blocks tail first,
    so its tail (least likely to be shared) is evicted before its head.

    The queue is a deque of blocks with lazy deletion: a prefix hit that reuses a
    free block leaves its entry in place, stale. A block's live entry is its last
    one, and only while the block is free (``ref_cnt == 0``); allocation skips the
    others as they reach the front (``num_queued`` counts a block's entries). The
    last entry is the live one because only a cached block can have stale entries
    (prefix hits take cached blocks), and a cached block is queued at the back,
    behind them; a block pushed to the front has no other entries. Every block
    passes through the queue once per use, so this is the allocator's hot path: a
    deque append/popleft is several times cheaper than an OrderedDict move.
    """

    def __init__(
        self, num_blocks: int, enable_caching: bool = True, reserve_null: bool = False
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if reserve_null and num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 with a null block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        for b in self.blocks:
            b.num_queued = 1
        # The null block (id 0, with sliding-window groups): the id a block table holds
        # where a window has dropped a block. Never free, never written, never read.
        self.num_reserved = 1 if reserve_null else 0
        if reserve_null:
            self.blocks[0].ref_cnt = 1
            self.blocks[0].num_queued = 0
        self.free_queue: deque[KVCacheBlock] = deque(self.blocks[self.num_reserved :])
        self.num_free = num_blocks - self.num_reserved
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return self.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / (self.num_blocks - self.num_reserved)

    def _live_entries(self) -> list[KVCacheBlock]:
        """The free queue without its stale entries, front first."""
        live: list[KVCacheBlock] = []
        seen: set[int] = set()
        for block in reversed(self.free_queue):  # a block's last entry comes first here
            if block.block_id not in seen:
                seen.add(block.block_id)
                if block.ref_cnt == 0:
                    live.append(block)
        live.reverse()
        return live

    def free_block_ids(self) -> list[int]:
        """The free blocks in eviction order (front first): tests and inspection."""
        return [b.block_id for b in self._live_entries()]

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def allocate(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks off the front of the free queue, evicting their hashes."""
        blocks = self.blocks
        return [blocks[i] for i in self.allocate_ids(n)]

    def allocate_ids(self, n: int) -> list[int]:
        """``allocate`` returning block ids (the hot path: ids are what tables hold)."""
        if n > self.num_free:
            raise RuntimeError(f"allocate({n}) with only {self.num_free} free blocks")
        popleft = self.free_queue.popleft
        cached = self.cached
        num_cached = len(cached)
        ids: list[int] = []
        for _ in range(n):
            block = popleft()
            block.num_queued -= 1
            while block.num_queued or block.ref_cnt:
                # Stale: reused by a prefix hit (and maybe freed again) since.
                block = popleft()
                block.num_queued -= 1
            h = block.block_hash
            if h is not None:
                # Evict: its contents are about to be overwritten. A block carries a
                # hash only while it is the cached block for it (duplicates stay
                # private), so the map entry is this block's.
                del cached[h]
                block.block_hash = None
            block.ref_cnt = 1
            ids.append(block.block_id)
        self.num_free -= n
        self.num_evictions += num_cached - len(cached)
        return ids

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take a reference on cached blocks a new request reuses."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.num_free -= 1  # its queue entry goes stale
            block.ref_cnt += 1
        # Stale entries are dropped as they reach the front; bound them if prefix hits
        # outpace allocation.
        if len(self.free_queue) > 2 * self.num_blocks + 64:
            live = self._live_entries()
            for block in self.free_queue:
                block.num_queued = 0
            for block in live:
                block.num_queued = 1
            self.free_queue = deque(live)

    def free(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference from each block; pass them in eviction order (tail first)."""
        free_queue = self.free_queue
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                block.num_queued += 1
                if block.block_hash is None:
                    free_queue.appendleft(block)
                else:
                    free_queue.append(block)
                self.num_free += 1

    def free_ids(self, block_ids: list[int]) -> None:
        """``free`` by block id, walking ``block_ids`` from its end (a block table's
        tail is evicted first)."""
        free_queue = self.free_queue
        append, appendleft = free_queue.append, free_queue.appendleft
        blocks = self.blocks
        num_freed = 0
        for block_id in reversed(block_ids):
            block = blocks[block_id]
            cnt = block.ref_cnt - 1
            block.ref_cnt = cnt
            if cnt == 0:
                block.num_queued += 1
                if block.block_hash is None:
                    appendleft(block)
                else:
                    append(block)
                num_freed += 1
        self.num_free += num_freed

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Record that ``block`` holds the full block with ``block_hash``."""
        if block.block_hash is not None:
            return
        # Keep the first block for a hash: duplicates (two requests that computed the
        # same prefix in the same step) stay private and are evicted normally.
        if block_hash in self.cached:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if self.num_free != self.num_blocks - self.num_reserved:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        return True

    def check_invariants(self) -> None:
        """Invariant 1 (the part the pool can see alone): free xor referenced."""
        free_ids = self.free_block_ids()
        assert len(free_ids) == self.num_free <= self.num_blocks - self.num_reserved
        if self.num_reserved:
            assert self.blocks[0].ref_cnt == 1 and self.blocks[0].block_hash is None
        assert len(set(free_ids)) == len(free_ids)
        free = set(free_ids)
        assert sum(b.num_queued for b in self.blocks) == len(self.free_queue)
        for block in self.blocks:
            assert block.ref_cnt >= 0, block
            assert (block.block_id in free) == (block.ref_cnt == 0), block
            assert block.ref_cnt > 0 or block.num_queued > 0, block
        for h, block in self.cached.items():
            assert block.block_hash == h, (h, block)
        for block in self.blocks:
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, block


class HostBlockPool:
    """Host-memory blocks for swap preemption: a plain free list, no caching."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free_ids: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self.free_ids)
        out = self.free_ids[-n:] if n else []
        del self.free_ids[len(self.free_ids) - n :]
        return out

    def free(self, block_ids: list[int]) -> None:
        self.free_ids.extend(block_ids)
