from iterserve.core.block_pool import BlockPool
from iterserve.core.kv_cache_manager import KVCacheManager

from .helpers import make_request


def test_allocate_and_free_keep_accounting():
    pool = BlockPool(8)
    blocks = pool.allocate(3)
    assert pool.num_free_blocks == 5
    assert all(b.ref_cnt == 1 for b in blocks)
    pool.free(list(reversed(blocks)))
    assert pool.num_free_blocks == 8
    pool.check_invariants()


def test_freed_hashless_blocks_are_evicted_before_cached_ones():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"key-a")
    pool.free([b, a])  # b has no hash: it goes to the front
    # Hashless blocks hold nothing reusable: they go first, cached ones last.
    order = [blk.block_id for blk in pool.allocate(3)]
    assert order == [b.block_id, 2, 3]
    assert pool.get_cached_block(b"key-a") is a
    pool.allocate(1)
    assert pool.get_cached_block(b"key-a") is None  # evicted when reused
    assert pool.num_evictions == 1


def test_request_tail_blocks_evicted_first():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    req = make_request("a", list(range(1, 13)))  # 3 full blocks
    assert kv.allocate_slots(req, 12) is not None
    req.num_computed_tokens = 12
    kv.cache_full_blocks(req)
    head, mid, tail = req.block_ids
    kv.free(req)
    # 3 never-used blocks first, then the request's tail, mid, head.
    order = [b.block_id for b in kv.pool.allocate(6)]
    assert order[3:] == [tail, mid, head]


def test_prefix_hits_and_ref_counts_across_two_requests():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    shared = list(range(1, 9))  # two full blocks
    a = make_request("a", [*shared, 50, 51, 52])
    blocks, n = kv.get_computed_blocks(a)
    assert (blocks, n) == ([], 0)
    kv.allocate_slots(a, a.num_tokens)
    a.num_computed_tokens = a.num_tokens
    kv.cache_full_blocks(a)

    b = make_request("b", [*shared, 60])
    blocks, n = kv.get_computed_blocks(b)
    assert n == 8
    assert [blk.block_id for blk in blocks] == a.block_ids[:2]
    kv.allocate_slots(b, b.num_tokens - n, blocks)
    b.num_computed_tokens = b.num_tokens
    for blk in blocks:
        assert blk.ref_cnt == 2
    kv.free(a)
    for blk in blocks:
        assert blk.ref_cnt == 1
    kv.free(b)
    assert kv.num_free_blocks == 16
    kv.pool.check_invariants()


def test_last_prompt_token_never_counts_as_cached():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = make_request("a", list(range(1, 9)))  # exactly two blocks
    kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    kv.cache_full_blocks(a)
    b = make_request("b", list(range(1, 9)))
    _, n = kv.get_computed_blocks(b)
    assert n == 4  # the second block holds the last token: must be computed


def test_hash_chain_distinguishes_same_block_after_different_prefix():
    kv = KVCacheManager(num_blocks=16, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 9])
    kv.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    kv.cache_full_blocks(a)
    b = make_request("b", [7, 7, 3, 4, 9])  # same second block, different first
    _, n = kv.get_computed_blocks(b)
    assert n == 0


def test_allocate_failure_leaves_state_untouched():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", list(range(1, 9)))
    kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    kv.cache_full_blocks(a)
    kv.free(a)
    b = make_request("b", [*range(1, 9), *range(100, 120)])  # needs 7 blocks, has 2 cached
    blocks, n = kv.get_computed_blocks(b)
    assert n == 8
    free_before = kv.pool.free_block_ids()
    refs_before = [blk.ref_cnt for blk in kv.pool.blocks]
    assert kv.allocate_slots(b, b.num_tokens - n, blocks) is None
    assert kv.pool.free_block_ids() == free_before
    assert [blk.ref_cnt for blk in kv.pool.blocks] == refs_before
    assert b.block_ids == []
    assert kv.pool.get_cached_block(b.block_hashes[0]) is not None


def test_swap_out_and_in_round_trip():
    kv = KVCacheManager(num_blocks=8, block_size=4, num_host_blocks=4)
    a = make_request("a", list(range(1, 11)))
    kv.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    device = list(a.block_ids)
    out = kv.swap_out(a)
    assert [d for d, _ in out] == device
    assert kv.num_free_blocks == 8 and kv.host_pool.num_free_blocks == 1
    back = kv.swap_in(a, 1)
    assert [h for h, _ in back] == [h for _, h in out]
    assert kv.host_pool.num_free_blocks == 4
    assert len(a.block_ids) == 3
    # The host pool refuses what it cannot hold, and nothing changes.
    big = make_request("b", list(range(1, 30)))
    kv.allocate_slots(big, 20)
    big.num_computed_tokens = 20
    kv.host_pool.allocate(2)
    held = list(big.block_ids)
    assert kv.swap_out(big) is None
    assert big.block_ids == held and big.host_block_ids == []
