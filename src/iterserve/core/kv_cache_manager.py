"""Per-request block tables on top of the BlockPool: prefix lookup, allocation, freeing, swap maps.

A request's device block table is ``request.block_ids``; only this class mutates it.
"""

from __future__ import annotations

from collections.abc import Sequence

from iterserve.core.block_hash import (
    BlockHash,
    extend_block_hashes,
    get_hash_fn,
    root_hash,
)
from iterserve.core.block_pool import BlockPool, HostBlockPool, KVCacheBlock
from iterserve.core.request import Request


class KVCacheManager:
    """One KV cache group (every layer attends globally): the request's one table is
    ``request.block_ids``. Hybrid models use ``HybridKVCacheManager`` (one table per
    group), which overrides the methods below that depend on the groups."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        num_host_blocks: int = 0,
        hash_algo: str = "sha256",
    ) -> None:
        self.block_size = block_size
        # KV cache groups (one here), and the id a table holds for a block a sliding
        # window dropped (None: no such ids).
        self.num_groups = 1
        self.null_block_id: int | None = None
        self.enable_caching = enable_caching
        self.hash_algo = hash_algo
        self.hash_fn = get_hash_fn(hash_algo)
        # The first block's parent for requests without a cache_salt.
        self.root_hash = root_hash(self.hash_fn)
        self.pool = BlockPool(num_blocks, enable_caching)
        self.host_pool = HostBlockPool(num_host_blocks)
        # Requests whose KV is swapped out to host blocks right now.
        self.num_swapped_requests = 0
        # Prefix-cache counters, in tokens, counted once per admission.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_blocks(self) -> int:
        """Blocks requests can hold (the pool less its null block, if any)."""
        return self.pool.num_blocks - self.pool.num_reserved

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return self.pool.usage

    # -- estimates (admission's reservations, the longest request that fits) --------

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks ``num_tokens`` more tokens of a prefill will take as it runs."""
        return -(-num_tokens // self.block_size)

    def blocks_to_hold(self, num_tokens: int) -> int:
        """Blocks a request of ``num_tokens`` uncomputed tokens holds when all of them
        are in (and a decode slot)."""
        return num_tokens // self.block_size + 1

    def capacity_tokens(self, max_chunk: int) -> int:
        """The longest context one request can hold alone (chunks of at most
        ``max_chunk`` tokens)."""
        return self.num_blocks * self.block_size

    # -- hashing -----------------------------------------------------------------

    def _extend_block_hashes(self, request: Request, num_full_blocks: int) -> list[BlockHash]:
        """The request's block keys up to ``num_full_blocks`` (see core/block_hash.py),
        extended lazily: each block is hashed once, when it first fills."""
        hashes = request.block_hashes
        if len(hashes) >= num_full_blocks:
            return hashes
        salt = request.cache_salt
        root = self.root_hash if salt is None else root_hash(self.hash_fn, salt)
        return extend_block_hashes(
            self.hash_fn, self.block_size, request.all_token_ids, hashes, num_full_blocks, root
        )

    # -- lookup and allocation ----------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of full blocks, and its length in tokens.

        The last token of the sequence never counts as cached: the model must
        compute at least one token to produce the next token's logits.
        """
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        if max_blocks <= 0:
            return [], 0
        hashes = self._extend_block_hashes(request, max_blocks)
        cached = self.pool.cached
        blocks: list[KVCacheBlock] = []
        for i in range(max_blocks):
            block = cached.get(hashes[i])
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens

    def can_allocate(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
    ) -> bool:
        bs = self.block_size
        total = request.num_computed_tokens + len(new_computed_blocks) * bs + num_new_tokens
        need = -(-total // bs) - len(request.block_ids) - len(new_computed_blocks)
        # Cached blocks with no holder sit in the free queue: reusing one takes it out.
        need += sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        return need <= self.pool.num_free

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
    ) -> list[int] | None:
        """Grow ``request``'s block table to hold ``num_new_tokens`` more tokens.

        ``new_computed_blocks`` are prefix-cache hits to prepend (first admission
        only). Returns the newly allocated block ids, or None when they do not fit,
        in which case nothing at all has changed.
        """
        bs = self.block_size
        block_ids = request.block_ids
        num_computed_blocks = len(new_computed_blocks)
        total = request.num_computed_tokens + num_computed_blocks * bs + num_new_tokens
        need = -(-total // bs) - len(block_ids) - num_computed_blocks
        pool = self.pool
        if num_computed_blocks:
            num_touch_free = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
            if need + num_touch_free > pool.num_free:
                return None
            pool.touch(new_computed_blocks)
            block_ids.extend(b.block_id for b in new_computed_blocks)
            request.num_cached_blocks = num_computed_blocks
        elif need > pool.num_free:
            return None
        if need <= 0:
            return []
        new_ids = pool.allocate_ids(need)
        block_ids.extend(new_ids)
        return new_ids

    def cache_full_blocks(self, request: Request) -> None:
        """Offer the request's newly *computed* full blocks to the prefix cache.

        Called after a step has written their KV, never at allocation time: a block
        cached before its KV exists could be reused by another request and read as
        garbage if its owner were preempted before the forward pass.
        """
        bs = self.block_size
        num_full = request.num_computed_tokens // bs
        start = request.num_cached_blocks
        if num_full <= start:
            return
        hashes = self._extend_block_hashes(request, num_full)
        blocks = self.pool.blocks
        cached = self.pool.cached
        # BlockPool.cache_block inlined (every block of every request passes here): keep
        # the first block for a hash; a duplicate (same prefix computed twice in one
        # step) stays private.
        for block_id, h in zip(request.block_ids[start:num_full], hashes[start:num_full]):
            block = blocks[block_id]
            if block.block_hash is None and h not in cached:
                block.block_hash = h
                cached[h] = block
        request.num_cached_blocks = num_full

    def trim(self, request: Request, num_tokens: int) -> None:
        """Give back the blocks past the first ``ceil(num_tokens / block_size)``: the
        lookahead slots of rejected draft tokens (speculative decoding). Those blocks
        were never offered to the prefix cache (only computed tokens are)."""
        keep = -(-num_tokens // self.block_size)
        block_ids = request.block_ids
        if len(block_ids) > keep:
            assert keep >= request.num_cached_blocks
            self.pool.free_ids(block_ids[keep:])
            del block_ids[keep:]

    def free(self, request: Request) -> None:
        """Release the request's device blocks, tail first (evicted first)."""
        block_ids = request.block_ids
        if block_ids:
            self.pool.free_ids(block_ids)
            block_ids.clear()
        request.num_cached_blocks = 0

    def free_host(self, request: Request) -> None:
        if request.host_block_ids:
            self.host_pool.free(request.host_block_ids)
            request.host_block_ids = []
            self.num_swapped_requests -= 1

    # -- swap preemption ----------------------------------------------------------

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the computed part of the request's KV to host blocks.

        Returns (device block, host block) copies for the executor, or None when the
        host pool is too small (the caller then falls back to recompute).
        """
        n = -(-request.num_computed_tokens // self.block_size)
        if n > self.host_pool.num_free_blocks:
            return None
        host_ids = self.host_pool.allocate(n)
        mapping = list(zip(request.block_ids[:n], host_ids))
        return self._finish_swap_out(request, host_ids, mapping)

    def _finish_swap_out(self, request: Request, host_ids: list[int],
                         mapping: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Record the request's host blocks and release its device blocks."""
        request.host_block_ids = host_ids
        if host_ids:
            self.num_swapped_requests += 1
        # The device blocks go back to the pool (their cached hashes stay valid until
        # reuse); the executor copies them out before this step's forward pass writes.
        self.free(request)
        return mapping

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Bring a swapped-out request back and make room for ``num_new_tokens`` more.

        Returns (host block, device block) copies, or None when device blocks are short.
        """
        assert not request.block_ids
        need = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size)
        if need > self.pool.num_free:
            return None
        new_ids = self.pool.allocate_ids(need)
        request.block_ids.extend(new_ids)
        host_ids = request.host_block_ids
        mapping = list(zip(host_ids, new_ids))
        self.free_host(request)
        # Re-offer the swapped-in full blocks to the prefix cache after this step.
        request.num_cached_blocks = 0
        return mapping
