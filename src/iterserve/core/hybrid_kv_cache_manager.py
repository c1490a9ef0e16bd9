"""The KV cache manager for several KV cache groups (core/kv_groups.py): one block
table per group per request, every group's ids from one pool.

``request.block_tables[g]`` is group ``g``'s table (``[0]`` is ``request.block_ids``).
All tables of a request have the same length: slot ``i`` holds token positions
``i * block_size ..`` in every group. A sliding-window group never holds a block its
window has left: such slots hold the null block (pool id 0, which attention never
reads), whether the block was released (``_drop_out_of_window``, before each
allocation) or never allocated (a prefix-cache hit's or a chunk's blocks behind the
window). The prefix cache keys a group's blocks by the block hash tagged with the
group, so each group caches its own layers' KV for the same tokens.

Swap preemption moves every group's blocks that later steps read (a sliding group's
window, a full group's whole table) to host blocks, in group order; swapping in
rebuilds each table with its out-of-window slots as the null block, so the same
positions are derived again from the request's computed length.
"""

from __future__ import annotations

from collections.abc import Sequence

from iterserve.core.block_hash import BlockHash
from iterserve.core.block_pool import BlockPool, KVCacheBlock
from iterserve.core.kv_cache_manager import KVCacheManager
from iterserve.core.kv_groups import KVCacheGroupSpec, first_needed_block
from iterserve.core.request import Request

NULL_BLOCK_ID = 0


def group_key(block_hash: BlockHash, group: int) -> BlockHash:
    """Group ``group``'s prefix-cache key for a block: group 0 keeps the plain hash
    (what routers predict), later groups append their index."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")


class HybridKVCacheManager(KVCacheManager):
    def __init__(
        self,
        groups: Sequence[KVCacheGroupSpec],
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        num_host_blocks: int = 0,
        hash_algo: str = "sha256",
    ) -> None:
        if len(groups) < 2:
            raise ValueError(f"kv_cache_groups: a hybrid cache needs >= 2 groups, got {len(groups)}")
        super().__init__(num_blocks, block_size, enable_caching, num_host_blocks, hash_algo)
        self.pool = BlockPool(num_blocks, enable_caching, reserve_null=True)
        self.null_block_id = NULL_BLOCK_ID
        self.groups = list(groups)
        self.windows: list[int | None] = [g.sliding_window for g in groups]
        self.num_groups = len(groups)
        self.num_full_groups = sum(1 for w in self.windows if w is None)

    # -- per-request tables -----------------------------------------------------------

    def _tables(self, request: Request) -> list[list[int]]:
        tables = request.block_tables
        if len(tables) < self.num_groups:
            tables.extend([] for _ in range(self.num_groups - len(tables)))
        return tables

    def num_held_blocks(self, request: Request) -> int:
        """Real blocks (not the null block) in the request's tables."""
        return sum(
            sum(1 for b in t if b != NULL_BLOCK_ID) for t in request.block_tables
        )

    # -- estimates ----------------------------------------------------------------------

    def _window_blocks(self, w: int, chunk: int) -> int:
        """Most blocks a sliding group holds during a step of ``chunk`` tokens: the
        window behind the chunk's first query, the chunk, and a partial block each end."""
        return -(-(w - 1 + chunk) // self.block_size) + 1

    def blocks_for(self, num_tokens: int) -> int:
        n = -(-num_tokens // self.block_size)
        return sum(n if w is None else min(n, self._window_blocks(w, 1)) for w in self.windows)

    def blocks_to_hold(self, num_tokens: int) -> int:
        n = num_tokens // self.block_size + 1
        return sum(n if w is None else min(n, self._window_blocks(w, 1)) for w in self.windows)

    def _peak_blocks(self, num_tokens: int, max_chunk: int) -> int:
        n = -(-num_tokens // self.block_size)
        return sum(
            n if w is None else min(n, self._window_blocks(w, max_chunk)) for w in self.windows
        )

    def capacity_tokens(self, max_chunk: int) -> int:
        usable = self.num_blocks
        hi = usable * self.block_size
        if self._peak_blocks(hi, max_chunk) <= usable:
            return hi
        lo = 0  # _peak_blocks(lo) <= usable < _peak_blocks(hi): bisect
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self._peak_blocks(mid, max_chunk) <= usable:
                lo = mid
            else:
                hi = mid
        return lo

    # -- lookup -------------------------------------------------------------------------

    def _sliding_hit(self, hashes: list[BlockHash], group: int, w: int, m: int) -> int:
        """The longest hit of at most ``m`` blocks for sliding group ``group``: blocks
        ``first_needed_block(hit) .. hit - 1`` all cached (earlier ones are not read).
        Scans back from ``m``; a missing block moves the candidate end onto it."""
        cached = self.pool.cached
        bs = self.block_size
        end = m
        i = m - 1  # blocks i + 1 .. end - 1 are cached
        while end > 0:
            first = first_needed_block(end * bs, w, bs)
            while i >= first and group_key(hashes[i], group) in cached:
                i -= 1
            if i < first:
                return end
            end = i  # block i is missing: a hit ends at or before it
            i = end - 1
        return 0

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest prefix every group can serve from the cache, as its blocks
        group after group (``m`` each; a sliding group's blocks behind its window are
        the null block), and its length in tokens."""
        if not self.enable_caching:
            return [], 0
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        if max_blocks <= 0:
            return [], 0
        hashes = self._extend_block_hashes(request, max_blocks)
        cached = self.pool.cached
        m = max_blocks
        for g, w in enumerate(self.windows):
            if w is None:  # a full group's hit is a prefix: the first miss ends it
                for i in range(m):
                    if group_key(hashes[i], g) not in cached:
                        m = i
                        break
        changed = True
        while changed and m:
            changed = False
            for g, w in enumerate(self.windows):
                if w is not None:
                    hit = self._sliding_hit(hashes, g, w, m)
                    if hit < m:
                        m, changed = hit, True
        if not m:
            return [], 0
        null = self.pool.blocks[NULL_BLOCK_ID]
        blocks: list[KVCacheBlock] = []
        for g, w in enumerate(self.windows):
            first = first_needed_block(m * bs, w, bs)
            blocks.extend([null] * first)
            blocks.extend(cached[group_key(hashes[i], g)] for i in range(first, m))
        return blocks, m * bs

    # -- allocation ---------------------------------------------------------------------

    def _drop_out_of_window(self, request: Request, num_computed: int) -> None:
        """Release each sliding group's blocks that no step from ``num_computed`` on
        reads. Slots before a null slot are null already, so scan back to the first."""
        tables = request.block_tables
        bs = self.block_size
        freed: list[int] = []
        for g, w in enumerate(self.windows):
            if w is None or g >= len(tables):
                continue
            t = tables[g]
            i = min(first_needed_block(num_computed, w, bs), len(t)) - 1
            while i >= 0 and t[i] != NULL_BLOCK_ID:
                freed.append(t[i])
                t[i] = NULL_BLOCK_ID
                i -= 1
        if freed:
            self.pool.free_ids(freed)  # walked from its end: the oldest block is evicted first

    def _num_new(self, cur: int, target: int, num_computed: int) -> int:
        bs = self.block_size
        need = 0
        for w in self.windows:
            start = max(cur, first_needed_block(num_computed, w, bs))
            if target > start:
                need += target - start
        return need

    def can_allocate(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
    ) -> bool:
        m = len(new_computed_blocks) // self.num_groups
        bs = self.block_size
        c = request.num_computed_tokens + m * bs
        cur = m if m else len(request.block_ids)
        need = self._num_new(cur, -(-(c + num_new_tokens) // bs), c)
        need += sum(
            1 for b in new_computed_blocks if b.ref_cnt == 0 and b.block_id != NULL_BLOCK_ID
        )
        return need <= self.pool.num_free

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
    ) -> list[int] | None:
        """As ``KVCacheManager.allocate_slots``, per group: every table grows to
        ``ceil(total / block_size)`` slots, a sliding group's slots behind its window
        (for the first of the new tokens) as the null block. First the blocks no
        later step reads are released (that much changes even when None is returned:
        nothing the request needs)."""
        tables = self._tables(request)
        bs = self.block_size
        pool = self.pool
        m = len(new_computed_blocks) // self.num_groups
        c = request.num_computed_tokens + m * bs
        self._drop_out_of_window(request, c)
        cur = m if m else len(tables[0])
        target = -(-(c + num_new_tokens) // bs)
        need = self._num_new(cur, target, c)
        if m:
            real = [b for b in new_computed_blocks if b.block_id != NULL_BLOCK_ID]
            if need + sum(1 for b in real if b.ref_cnt == 0) > pool.num_free:
                return None
            pool.touch(real)
            for g in range(self.num_groups):
                tables[g].extend(b.block_id for b in new_computed_blocks[g * m : (g + 1) * m])
            request.num_cached_blocks = m
        elif need > pool.num_free:
            return None
        if target <= cur:
            return []
        new_ids: list[int] = []
        for g, w in enumerate(self.windows):
            t = tables[g]
            start = max(cur, first_needed_block(c, w, bs))
            if start > cur:
                t.extend([NULL_BLOCK_ID] * (min(start, target) - cur))
            if target > start:
                ids = pool.allocate_ids(target - start)
                t.extend(ids)
                new_ids.extend(ids)
        return new_ids

    def cache_full_blocks(self, request: Request) -> None:
        bs = self.block_size
        num_full = request.num_computed_tokens // bs
        start = request.num_cached_blocks
        if num_full <= start:
            return
        hashes = self._extend_block_hashes(request, num_full)
        blocks = self.pool.blocks
        cached = self.pool.cached
        for g, t in enumerate(self._tables(request)):
            for i in range(start, num_full):
                block_id = t[i]
                if block_id == NULL_BLOCK_ID:
                    continue  # out of the window before it was cached: never held
                block = blocks[block_id]
                key = group_key(hashes[i], g)
                if block.block_hash is None and key not in cached:
                    block.block_hash = key
                    cached[key] = block
        request.num_cached_blocks = num_full

    def trim(self, request: Request, num_tokens: int) -> None:
        keep = -(-num_tokens // self.block_size)
        for t in self._tables(request):
            if len(t) > keep:
                assert keep >= request.num_cached_blocks
                self.pool.free_ids([b for b in t[keep:] if b != NULL_BLOCK_ID])
                del t[keep:]

    def free(self, request: Request) -> None:
        """Release every group's blocks, each table tail first; the global groups'
        last, so their (longer-lived, most shareable) blocks are evicted last."""
        tables = request.block_tables
        for g in range(len(tables) - 1, -1, -1):
            t = tables[g]
            if t:
                self.pool.free_ids([b for b in t if b != NULL_BLOCK_ID])
                t.clear()
        request.num_cached_blocks = 0

    def _swapped_slots(self, num_computed: int) -> list[tuple[int, int]]:
        """(group, slot) of every block a swap of a request with ``num_computed``
        tokens moves, in the order its host blocks are allocated."""
        bs = self.block_size
        n = -(-num_computed // bs)
        return [(g, i) for g, w in enumerate(self.windows)
                for i in range(first_needed_block(num_computed, w, bs), n)]

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """As ``KVCacheManager.swap_out``, per group: the blocks no later step reads
        are released first, not copied."""
        c = request.num_computed_tokens
        tables = self._tables(request)
        self._drop_out_of_window(request, c)
        slots = self._swapped_slots(c)
        if len(slots) > self.host_pool.num_free_blocks:
            return None
        host_ids = self.host_pool.allocate(len(slots))
        mapping = [(tables[g][i], h) for (g, i), h in zip(slots, host_ids)]
        assert all(d != NULL_BLOCK_ID for d, _ in mapping)
        return self._finish_swap_out(request, host_ids, mapping)

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """As ``KVCacheManager.swap_in``, per group: each table gets the null block
        behind its window, the swapped blocks back, and room for the new tokens."""
        assert not request.block_ids
        bs = self.block_size
        c = request.num_computed_tokens
        target = -(-(c + num_new_tokens) // bs)
        if self._num_new(0, target, c) > self.pool.num_free:
            return None
        slots = self._swapped_slots(c)
        host_ids = request.host_block_ids
        assert len(slots) == len(host_ids)
        tables = self._tables(request)
        for g, w in enumerate(self.windows):
            start = min(first_needed_block(c, w, bs), target)
            tables[g].extend([NULL_BLOCK_ID] * start)
            tables[g].extend(self.pool.allocate_ids(target - start))
        mapping = [(h, tables[g][i]) for (g, i), h in zip(slots, host_ids)]
        self.free_host(request)
        request.num_cached_blocks = 0  # re-offered to the prefix cache after this step
        return mapping
