"""The device's KV blocks: ref counts, a free queue in eviction order, a hash -> block map.

Invariant: a block is in the free queue iff its ref count is 0. A freed block
keeps its hash (stays findable by prefix lookups) until it is taken for reuse,
so "free" includes "cached but evictable".
"""

from __future__ import annotations

from collections import OrderedDict


class KVCacheBlock:
    __slots__ = ("block_hash", "block_id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` token slots.

    Eviction order of the free queue (front is evicted first):
    blocks with no hash (nothing to reuse) go to the front; cached blocks go to
    the back in the order they are freed. A request frees its blocks tail first,
    so its tail (least likely to be shared) is evicted before its head.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # OrderedDict as an O(1) LRU: popitem(last=False) evicts, pop(id) "touches".
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks
        )
        self.cached: dict[int, KVCacheBlock] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_queue) / self.num_blocks

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def allocate(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks off the front of the free queue, evicting their hashes."""
        blocks = self.blocks
        return [blocks[i] for i in self.allocate_ids(n)]

    def allocate_ids(self, n: int) -> list[int]:
        """``allocate`` returning block ids (the hot path: ids are what tables hold)."""
        free_queue = self.free_queue
        if n > len(free_queue):
            raise RuntimeError(f"allocate({n}) with only {len(free_queue)} free blocks")
        popitem = free_queue.popitem
        taken = [popitem(False) for _ in range(n)]  # False: from the front (LRU end)
        cached = self.cached
        for _, block in taken:
            h = block.block_hash
            if h is not None:
                # Evict: its contents are about to be overwritten.
                if cached.get(h) is block:
                    del cached[h]
                block.block_hash = None
                self.num_evictions += 1
            block.ref_cnt = 1
        return [block_id for block_id, _ in taken]

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on cached blocks a new request reuses."""
        free_queue = self.free_queue
        for block in blocks:
            if block.ref_cnt == 0:
                del free_queue[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference from each block; pass them in eviction order (tail first)."""
        free_queue = self.free_queue
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                free_queue[block.block_id] = block
                if block.block_hash is None:
                    free_queue.move_to_end(block.block_id, last=False)

    def cache_block(self, block: KVCacheBlock, block_hash: int) -> None:
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
        if len(self.free_queue) != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        return True

    def check_invariants(self) -> None:
        """Invariant 1 (the part the pool can see alone): free xor referenced."""
        assert len(self.free_queue) <= self.num_blocks
        for block in self.blocks:
            in_free = block.block_id in self.free_queue
            assert block.ref_cnt >= 0, block
            assert in_free == (block.ref_cnt == 0), block
        for h, block in self.cached.items():
            assert block.block_hash == h, (h, block)


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
