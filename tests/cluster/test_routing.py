"""Routing policies: determinism, load balance, the cache-aware prediction and its
imbalance gate, session affinity, corrections from replica stats."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter, deque
from pathlib import Path

import pytest

from iterserve.cluster import (
    ROUTER_POLICIES,
    CacheAwarePolicy,
    LeastLoadedPolicy,
    PowerOfTwoPolicy,
    ReplicaStats,
    ReplicaView,
    RequestView,
    RoundRobinPolicy,
    make_policy,
)
from tests.core.helpers import fake_model_output, make_request, make_scheduler

IDS = ["r0", "r1", "r2", "r3"]


def views(loads: dict[str, int] | None = None, ids=IDS) -> list[ReplicaView]:
    loads = loads or {}
    return [ReplicaView(r, num_running=loads.get(r, 0)) for r in ids]


def req(i: int, prefix: list[int] | None = None, n: int = 96, session: str | None = None,
        block_size: int = 16) -> RequestView:
    """A prompt of n tokens: the shared ``prefix`` then tokens unique to request i."""
    head = list(prefix or [])
    tail = [1000 + (i * 131 + j) % 30000 for j in range(n - len(head))]
    return RequestView.from_prompt(f"q{i}", head + tail, block_size=block_size,
                                   session_key=session)


def drive(policy, requests, *, depth: int, replicas=IDS) -> list[str]:
    """Route ``requests`` in order; each finishes after ``depth`` later arrivals (a
    queue of that many in flight). The policy's own counts are the only load signal."""
    in_flight: deque = deque()
    out = []
    for r in requests:
        target = policy.choose(r, views(ids=replicas))
        policy.on_routed(r, target)
        out.append(target)
        in_flight.append((r, target))
        if len(in_flight) > depth:
            policy.on_finished(*in_flight.popleft())
    return out


@pytest.mark.parametrize("name", ROUTER_POLICIES)
def test_every_policy_is_deterministic(name):
    prefix = list(range(5, 5 + 64))
    requests = [req(i, prefix if i % 3 == 0 else None, session=f"s{i % 5}")
                for i in range(60)]
    a = drive(make_policy(name), requests, depth=7)
    b = drive(make_policy(name), requests, depth=7)
    assert a == b
    assert set(a) <= set(IDS)


def test_round_robin_cycles_in_order():
    p = RoundRobinPolicy()
    assert drive(p, [req(i) for i in range(8)], depth=100) == IDS + IDS


def test_least_loaded_counts_running_waiting_and_its_own_routing():
    p = LeastLoadedPolicy()
    vs = [ReplicaView("r0", 3, 1), ReplicaView("r1", 1, 1), ReplicaView("r2", 2, 4)]
    assert p.rank(req(0), vs) == ["r1", "r0", "r2"]
    # vLLM's weighting: waiting counts 4x.
    vs = [ReplicaView("r0", 5, 0), ReplicaView("r1", 0, 2)]
    assert LeastLoadedPolicy().rank(req(0), vs) == ["r1", "r0"]
    assert LeastLoadedPolicy(waiting_weight=4).rank(req(0), vs) == ["r0", "r1"]
    # A stale report of 0 does not hide requests this policy sent.
    for i in range(3):
        p.on_routed(req(i), "r1")
    assert p.choose(req(9), [ReplicaView("r0", 2), ReplicaView("r1", 0)]) == "r0"
    # Equal loads rotate (least recently routed first).
    q = LeastLoadedPolicy()
    assert drive(q, [req(i) for i in range(8)], depth=0) == IDS + IDS


def test_power_of_two_never_picks_the_most_loaded_and_is_seeded():
    loads = {"r0": 50, "r1": 1, "r2": 2, "r3": 3}
    p = PowerOfTwoPolicy(seed=1)
    picks = [p.choose(req(i), views(loads)) for i in range(200)]
    assert "r0" not in picks and len(set(picks)) == 3  # r1..r3 all appear
    q = PowerOfTwoPolicy(seed=1)
    assert [q.choose(req(i), views(loads)) for i in range(200)] == picks
    r = PowerOfTwoPolicy(seed=2)
    assert [r.choose(req(i), views(loads)) for i in range(200)] != picks
    # Every rank is a permutation of the candidates.
    assert sorted(p.rank(req(0), views(loads))) == IDS


def test_cache_aware_routes_a_shared_prefix_to_the_replica_that_has_it():
    p = CacheAwarePolicy()
    prefix = list(range(5, 5 + 160))  # 10 blocks
    p.on_routed(req(0, prefix, n=200), "r2")
    assert p.matched_blocks(req(1, prefix, n=200), "r2") == 10
    assert p.matched_blocks(req(1, prefix, n=200), "r0") == 0
    assert p.choose(req(1, prefix, n=200), views()) == "r2"
    # No shared prefix: r2 is busier by one, so it is ranked last.
    assert p.rank(req(2), views())[-1] == "r2"


def test_cache_aware_prediction_matches_a_real_replica():
    """The router's keys are the KV cache's: its predicted hit is the replica's hit."""
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=64)
    prompt = list(range(10, 33))  # 23 tokens
    a = make_request("a", prompt, max_tokens=1, cache_salt="t1")
    sched.add_request(a)
    out = sched.schedule(0.0)
    sched.update(out, fake_model_output(out), 0.0)
    p = CacheAwarePolicy()
    p.on_routed(RequestView.from_prompt("a", prompt, block_size=4, cache_salt="t1"), "r0")
    hits = []
    for salt, tokens in (("t1", [*prompt, 7, 7]), ("t1", prompt[:13]), ("t2", prompt)):
        view = RequestView.from_prompt("b", tokens, block_size=4, cache_salt=salt)
        b = make_request("b", tokens, max_tokens=1, cache_salt=salt)
        _, hit = sched.kv.get_computed_blocks(b)
        assert p.matched_blocks(view, "r0") * 4 == hit
        hits.append(hit)
    assert hits == [20, 12, 0]  # 5 full blocks computed; 3 fit a 13-token prompt; salt


def test_imbalance_gate_routes_to_least_loaded():
    p = CacheAwarePolicy(balance_abs_threshold=32, balance_rel_threshold=1.1)
    prefix = list(range(5, 5 + 160))
    p.on_routed(req(0, prefix, n=200), "r1")
    # Imbalanced (gap 40 > 32 and 45 > 1.1 * 5): least loaded first, prefix ignored.
    loads = {"r0": 5, "r1": 45, "r2": 5, "r3": 5}
    assert p.choose(req(1, prefix, n=200), views(loads)) != "r1"
    assert p.rank(req(1, prefix, n=200), views(loads))[-1] == "r1"
    # Gap over the absolute threshold but within the relative one: the gate stays shut.
    loads = {"r0": 400, "r1": 436, "r2": 400, "r3": 400}
    assert not p.is_imbalanced(list(loads.values()))
    # Within the absolute threshold: the prefix wins while load_weight allows it.
    loads = {"r0": 0, "r1": 1, "r2": 0, "r3": 0}
    assert p.choose(req(2, prefix, n=200), views(loads)) == "r1"


def test_a_hot_prefix_still_spreads_over_replicas():
    prefix = list(range(5, 5 + 1024))  # a 1024-token system prompt everyone shares
    requests = [req(i, prefix, n=1100) for i in range(400)]
    picks = drive(CacheAwarePolicy(), requests, depth=80)
    counts = Counter(picks)
    assert set(counts) == set(IDS)
    assert max(counts.values()) < 0.4 * len(picks)  # no replica takes the lot
    # Once imbalance builds up, the gate caps the gap in routed-but-unfinished work.
    p = CacheAwarePolicy(load_weight=0.0)  # cache only: the gate alone must spread
    picks = drive(p, requests, depth=80)
    assert set(picks) == set(IDS)
    assert max(p.outstanding.values()) - min(p.outstanding.values()) <= 33


def test_without_shared_prefixes_cache_aware_is_least_loaded_and_round_robin():
    requests = [req(i) for i in range(200)]
    assert drive(CacheAwarePolicy(), requests, depth=9) == drive(
        LeastLoadedPolicy(), requests, depth=9)
    # Each finishes before the next: equal loads, so a plain rotation.
    assert drive(CacheAwarePolicy(), requests, depth=0) == drive(
        RoundRobinPolicy(), requests, depth=0)


def test_session_affinity():
    p = CacheAwarePolicy()
    p.on_routed(req(0, session="alice"), "r3")
    # Unrelated prompt, r3 busier by one: affinity still sends it to r3.
    assert p.choose(req(1, session="alice"), views()) == "r3"
    assert p.choose(req(1, session="bob"), views()) != "r3"
    # The gate overrides affinity.
    assert p.choose(req(1, session="alice"), views({"r3": 40})) != "r3"
    assert CacheAwarePolicy(session_affinity=False).choose(
        req(1, session="alice"), views()) == "r0"
    p.remove_replica("r3")
    assert p.choose(req(1, session="alice"), views(ids=IDS[:3])) == "r0"


def test_stats_correct_the_guess():
    prefix = list(range(5, 5 + 64))  # 4 blocks
    p = CacheAwarePolicy()
    r0 = req(0, prefix, n=80)  # 5 blocks
    p.on_routed(r0, "r0")
    probe = req(1, prefix, n=80)
    assert p.matched_blocks(probe, "r0") == 4
    # The replica evicted the third block: the match stops before it.
    p.update_stats("r0", ReplicaStats(removed_block_hashes=[r0.block_hashes[2]]))
    assert p.matched_blocks(probe, "r0") == 2
    # It holds only 3 keyed blocks now: the oldest (a request's tail) go first.
    p.on_routed(r0, "r0")
    p.update_stats("r0", ReplicaStats(num_cached_blocks=3))
    assert len(p.blocks["r0"]) == 3 and p.matched_blocks(probe, "r0") == 3
    # Capacity from the replica's block count bounds what later routing adds.
    p.update_stats("r0", ReplicaStats(num_gpu_blocks=2))
    p.on_routed(req(2, n=160), "r0")
    assert len(p.blocks["r0"]) == 2


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="router_policy"):
        make_policy("random")
    with pytest.raises(ValueError, match="replicas"):
        RoundRobinPolicy().choose(req(0), [])
    with pytest.raises(ValueError, match="balance_rel_threshold"):
        CacheAwarePolicy(balance_rel_threshold=0.5)


def test_the_package_never_imports_ray():
    src = Path(__file__).resolve().parents[2] / "src"
    for path in (src / "iterserve" / "cluster").glob("*.py"):
        if path.name.startswith("ray_"):  # the Ray Serve shell: ray_serve.py and its parts
            continue
        assert "import ray" not in path.read_text() and "from ray" not in path.read_text()
    code = ("import sys, iterserve.cluster, iterserve.cluster.adapter, iterserve.cluster.cli; "
            "assert not [m for m in sys.modules if m == 'ray' or m.startswith('ray.')]; "
            "assert 'torch' not in sys.modules")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src),
                                                        os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
