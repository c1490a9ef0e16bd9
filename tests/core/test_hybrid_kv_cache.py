"""KV cache groups: sliding-window groups free what their window left, allocate
nothing behind it, hit the prefix cache only where their window's blocks are cached,
and the scheduler counts each group's real need."""

from __future__ import annotations

import pytest

from iterserve.core.hybrid_kv_cache_manager import NULL_BLOCK_ID, HybridKVCacheManager
from iterserve.core.kv_groups import KVCacheGroupSpec, first_needed_block, make_kv_cache_groups

from .helpers import fake_model_output, make_request, make_scheduler, run_to_completion

GLOBAL, LOCAL = KVCacheGroupSpec(None, (1,)), KVCacheGroupSpec(8, (0,))


def _kv(num_blocks: int = 32, block_size: int = 4, caching: bool = True) -> HybridKVCacheManager:
    return HybridKVCacheManager([GLOBAL, LOCAL], num_blocks, block_size, enable_caching=caching)


def _real(table: list[int]) -> list[int]:
    return [b for b in table if b != NULL_BLOCK_ID]


def test_gemma3_1b_layer_pattern_makes_equal_groups():
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]
    groups = make_kv_cache_groups(windows)
    assert groups[0] == KVCacheGroupSpec(None, (5, 11, 17, 23))
    assert [g.sliding_window for g in groups] == [None] + [512] * 6
    assert groups[1].layers == (0, 1, 2, 3) and groups[-1].layers == (24, 25)
    assert sorted(i for g in groups for i in g.layers) == list(range(26))
    assert make_kv_cache_groups([None] * 3) == [KVCacheGroupSpec(None, (0, 1, 2))]
    with pytest.raises(ValueError, match="layer_windows"):
        make_kv_cache_groups([0, None])
    with pytest.raises(ValueError, match="sliding_window"):
        KVCacheGroupSpec(0)


def test_first_needed_block_is_the_first_querys_window():
    # A query at position p sees keys p - W + 1 .. p.
    assert first_needed_block(0, 8, 4) == 0
    assert first_needed_block(11, 8, 4) == 1  # keys from 4: block 1
    assert first_needed_block(12, 8, 4) == 1  # keys from 5
    assert first_needed_block(15, 8, 4) == 2  # keys from 8
    assert first_needed_block(100, None, 4) == 0


def test_decode_frees_blocks_behind_the_window():
    kv = _kv()
    req = make_request("a", 30)
    assert len(kv.allocate_slots(req, 30)) == 16
    full, local = req.block_tables
    assert full is req.block_ids and len(full) == len(local) == 8
    req.num_computed_tokens = 30
    before = kv.num_free_blocks
    kv.allocate_slots(req, 1)  # next query at 30 sees keys 23..: blocks 5.. only
    assert local[:5] == [NULL_BLOCK_ID] * 5 and NULL_BLOCK_ID not in local[5:]
    assert len(_real(full)) == 8
    assert kv.num_free_blocks == before + 5
    assert kv.num_held_blocks(req) == 11
    kv.free(req)
    assert kv.num_free_blocks == kv.num_blocks == 31  # block 0 is the null block


def test_chunked_prefill_allocates_only_what_each_chunk_reads():
    kv = _kv()
    req = make_request("a", 40)
    kv.allocate_slots(req, 16)
    req.num_computed_tokens = 16
    # The chunk at 16..31 reads keys from 9 (block 2) on: blocks 0, 1 go.
    new = kv.allocate_slots(req, 16)
    assert len(new) == 4 + 4
    assert req.block_tables[1][:2] == [NULL_BLOCK_ID] * 2
    req.num_computed_tokens = 32
    kv.allocate_slots(req, 8)
    assert req.block_tables[1][:6] == [NULL_BLOCK_ID] * 6
    assert len(_real(req.block_tables[1])) == 4 and len(_real(req.block_ids)) == 10


def test_a_hit_is_never_allocated_behind_the_window():
    kv = _kv()
    a = make_request("a", list(range(1, 42)))
    kv.allocate_slots(a, 41)
    a.num_computed_tokens = 41
    kv.cache_full_blocks(a)
    b = make_request("b", [*range(1, 42), 99])
    blocks, n = kv.get_computed_blocks(b)
    assert n == 40
    assert len(blocks) == 2 * 10
    # The local group needs keys from 33 (block 8) on for the next query at 40.
    local = blocks[10:]
    assert all(x.block_id == NULL_BLOCK_ID for x in local[:8])
    assert [x.block_id for x in local[8:]] == a.block_tables[1][8:10]
    kv.allocate_slots(b, b.num_tokens - n, blocks)
    assert b.block_tables[1][:8] == [NULL_BLOCK_ID] * 8
    assert b.block_ids[:10] == a.block_ids[:10]
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == kv.num_blocks


def test_a_local_group_hits_only_where_its_window_is_cached():
    kv = _kv(num_blocks=24)
    a = make_request("a", list(range(1, 42)))
    kv.allocate_slots(a, 16)
    a.num_computed_tokens = 16
    kv.cache_full_blocks(a)
    kv.allocate_slots(a, 25)
    a.num_computed_tokens = 41
    kv.cache_full_blocks(a)
    kv.allocate_slots(a, 1)  # frees the local blocks behind the window (still cached)
    b = make_request("b", [*range(1, 42), 7])
    _, n = kv.get_computed_blocks(b)
    assert n == 40
    # Evict every free cached block: take them all for another request.
    assert kv.num_free_blocks == 9
    other = make_request("c", 16)
    assert kv.allocate_slots(other, other.num_tokens) is not None
    assert kv.num_free_blocks == 1
    kv.free(a)  # a's blocks are cached and free again, but a's old local ones are gone
    _, n = kv.get_computed_blocks(b)
    # Full-group blocks 0..9 are all cached; the local group still has blocks 8, 9
    # (the window of a hit at 40), and nothing before them.
    assert n == 40
    c = make_request("d", list(range(1, 30)))
    _, n = kv.get_computed_blocks(c)
    assert n == 0  # a hit at 28 would need local blocks 5, 6: evicted


def test_allocation_that_does_not_fit_changes_no_table_length():
    kv = _kv(num_blocks=6)
    req = make_request("a", 40)
    assert kv.allocate_slots(req, 40) is None
    assert req.block_tables == [[], []] and kv.num_free_blocks == 5


def test_trim_gives_back_every_groups_tail():
    kv = _kv()
    req = make_request("a", 10)
    kv.allocate_slots(req, 10)
    req.num_computed_tokens = 9
    kv.allocate_slots(req, 7)  # lookahead to 16 tokens: 4 slots per group
    kv.trim(req, 10)
    assert len(req.block_ids) == len(req.block_tables[1]) == 3
    kv.free(req)
    assert kv.num_free_blocks == kv.num_blocks


def test_capacity_counts_each_groups_peak_need():
    # bs 4, window 8, chunks of 8: a local group holds at most ceil((7 + 8) / 4) + 1 = 5
    # blocks, so a lone request holds ceil(L / 4) + 5 <= 19 usable blocks: L = 56.
    sched = make_scheduler(20, 4, max_num_batched_tokens=8, max_model_len=256,
                           kv_cache_groups=[GLOBAL, LOCAL])
    assert sched.kv_capacity_tokens == 56
    sched.add_request(make_request("a", 40, max_tokens=17))
    with pytest.raises(ValueError, match="KV cache"):
        sched.add_request(make_request("b", 40, max_tokens=18))
    outputs, _ = run_to_completion(sched)
    assert [o.request_id for o in outputs if o.finish_reason] == ["a"]
    assert sched.num_preemptions == 0
    assert make_scheduler(20, 4).kv_capacity_tokens == 80


def test_scheduler_holds_a_window_per_local_group_not_the_context():
    groups = make_kv_cache_groups([16, 16, None])
    sched = make_scheduler(200, 4, max_num_batched_tokens=32, max_model_len=512,
                           kv_cache_groups=groups)
    req = make_request("a", 100, max_tokens=200)
    sched.add_request(req)
    peak_local = 0
    now = 0.0
    while sched.has_unfinished_requests():
        out = sched.schedule(now)
        sched.update(out, fake_model_output(out), now)
        sched.check_invariants()
        if req.block_tables[1:]:
            peak_local = max(peak_local, max(len(_real(t)) for t in req.block_tables[1:]))
        now += 1
    # Window 16 over blocks of 4 and chunks of 32: at most ceil(47 / 4) + 1 blocks.
    assert 0 < peak_local <= 13
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


@pytest.mark.parametrize(("mode", "swap_space"), [("recompute", 0), ("swap", 16), ("swap", 1)])
def test_preempted_hybrid_request_finishes(mode, swap_space):
    """Preempted by recompute, by swap, or by recompute where the host pool is too
    small for the swap: every request finishes, the invariants hold every step."""
    sched = make_scheduler(24, 4, max_num_batched_tokens=16, max_model_len=128,
                           preemption_mode=mode, swap_space=swap_space,
                           kv_cache_groups=[GLOBAL, LOCAL])
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 20, max_tokens=20))
    swapped = 0
    now = 0.0
    while sched.has_unfinished_requests():
        out = sched.schedule(now)
        swapped += len(out.blocks_to_swap_out)
        sched.update(out, fake_model_output(out), now)
        sched.check_invariants()
        now += 1
    assert sched.num_preemptions > 0
    assert (swapped > 0) == (swap_space >= 8)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert sched.kv.host_pool.num_free_blocks == swap_space


def test_swap_moves_only_what_later_steps_read():
    """A swap copies a full group's whole table and a local group's window, and the
    swap-in rebuilds both tables (null behind the window) onto the same host blocks."""
    kv = HybridKVCacheManager([GLOBAL, LOCAL], 32, 4, num_host_blocks=16)
    r = make_request("a", 30)
    kv.allocate_slots(r, 30)
    r.num_computed_tokens = 30
    full, local = list(r.block_tables[0]), list(r.block_tables[1])
    out = kv.swap_out(r)
    assert out is not None
    first = first_needed_block(30, 8, 4)  # the next query (30) sees 23 on: block 5
    assert first == 5
    assert [d for d, _ in out] == full + local[first:]
    assert r.block_tables == [[], []] and kv.num_free_blocks == kv.num_blocks
    back = kv.swap_in(r, 1)
    assert back is not None
    assert [h for h, _ in back] == [h for _, h in out]
    assert len(r.block_tables[0]) == len(r.block_tables[1]) == 8  # ceil(31 / 4)
    assert r.block_tables[1][:first] == [NULL_BLOCK_ID] * first
    assert [d for _, d in back] == r.block_tables[0] + r.block_tables[1][first:]
    assert kv.host_pool.num_free_blocks == 16 and kv.num_swapped_requests == 0


def test_swap_in_that_does_not_fit_changes_nothing():
    kv = HybridKVCacheManager([GLOBAL, LOCAL], 20, 4, num_host_blocks=16)
    r = make_request("a", 30)
    assert kv.allocate_slots(r, 30) is not None  # 8 + 8 of the 19 real blocks
    r.num_computed_tokens = 30
    assert kv.swap_out(r) is not None
    hog = make_request("b", 20)
    assert kv.allocate_slots(hog, 20) is not None  # 5 + 5: 9 left, the swap-in needs 8 + 3
    assert kv.swap_in(r, 1) is None
    assert r.block_tables == [[], []] and r.host_block_ids


def test_a_window_of_one_needs_no_cached_block():
    """Each query of a window-1 layer sees only itself: a hit needs none of its blocks."""
    kv = HybridKVCacheManager([GLOBAL, KVCacheGroupSpec(1, (0,))], 16, 4)
    a = make_request("a", 13)
    kv.allocate_slots(a, 13)
    a.num_computed_tokens = 13
    kv.cache_full_blocks(a)
    kv.allocate_slots(a, 1)  # the local group keeps only the block of position 13
    assert _real(a.block_tables[1]) == a.block_tables[1][3:]
    b = make_request("b", [*a.all_token_ids, 5])
    blocks, n = kv.get_computed_blocks(b)
    assert n == 12 and all(x.block_id == NULL_BLOCK_ID for x in blocks[3:])
