"""The scheduler's invariants (docs/architecture.md 1, 2 and 6), checked by tests between steps."""

from __future__ import annotations

from typing import TYPE_CHECKING

from iterserve.core.request import RequestStatus

if TYPE_CHECKING:
    from iterserve.core.scheduler import Scheduler

_RUNNING = RequestStatus.RUNNING


def check_invariants(s: Scheduler) -> None:
    """Every block's reference count matches the block tables; waiting requests hold no
    device blocks; every request is in exactly one place; the caps hold."""
    pool = s.kv.pool
    pool.check_invariants()
    refs = [0] * pool.num_blocks
    null = s.kv.null_block_id
    if null is not None:
        refs[null] = 1  # held by the pool itself; tables name it without a reference
    for req in s.running:
        tables = req.block_tables
        assert all(len(t) == len(req.block_ids) for t in tables), f"ragged tables: {req}"
        for t in tables:
            for b in t:
                if b != null:
                    refs[b] += 1
        assert len(tables) == s.kv.num_groups or not req.block_ids, req
    waiting = list(s.policy)
    for req in waiting:
        assert not any(req.block_tables), f"waiting request holds device blocks: {req}"
    for block in pool.blocks:
        assert block.ref_cnt == refs[block.block_id], (block, refs[block.block_id])
    used = sum(1 for r in refs if r)
    assert used + pool.num_free_blocks == pool.num_blocks
    host_used = sum(len(r.host_block_ids) for r in waiting)
    assert host_used + s.kv.host_pool.num_free_blocks == s.kv.host_pool.num_blocks
    assert s.kv.num_swapped_requests == sum(1 for r in waiting if r.host_block_ids)
    running_ids = {r.request_id for r in s.running}
    waiting_ids = {r.request_id for r in waiting}
    assert len(running_ids) == len(s.running), "duplicate in running"
    assert len(waiting_ids) == len(waiting), "duplicate in waiting"
    assert not running_ids & waiting_ids, running_ids & waiting_ids
    assert running_ids | waiting_ids == set(s.requests), "request lost or stray"
    for req in s.running:
        assert req.status is _RUNNING
    for req in waiting:
        assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
    assert len(s.running) <= s.max_num_seqs
    if not s.requests:
        assert pool.num_free_blocks == s.kv.num_blocks, "idle engine holds blocks"
