"""The policy adapter behind the Ray Serve request router, driven as Ray Serve drives it
(choose, routed, completed, replica reports, replicas going away) with fake replicas:
ids and stats dicts, no Ray."""

from __future__ import annotations

import subprocess
import sys

import pytest

from iterserve.cluster.adapter import PolicyAdapter, RoutingInfo, stats_from_dict

SYSTEM = list(range(100, 164))  # a 64-token shared prefix: 4 blocks of 16


def report(running: int = 0, waiting: int = 0, **extra: object) -> dict:
    return {"num_running": running, "num_waiting": waiting, "num_gpu_blocks": 64,
            "kv_cache_usage": 0.0, "metrics": "# not read by the policy\n", **extra}


def test_stats_dict_to_replica_stats():
    s = stats_from_dict(report(3, 2, num_cached_blocks=7, prefix_cache_hits=5))
    assert (s.num_running, s.num_waiting, s.num_gpu_blocks, s.num_cached_blocks,
            s.prefix_cache_hits) == (3, 2, 64, 7, 5)


def test_choose_ranks_through_the_policy_and_follows_the_prefix():
    a = PolicyAdapter("cache_aware")
    reps = [("r0", report()), ("r1", report())]
    first = a.choose("q0", RoutingInfo([*SYSTEM, 1]), reps)
    a.routed("q0", first[0])
    a.completed("q0")
    # The shared prefix is now on first[0]: the next request goes there, not elsewhere.
    for i in range(1, 4):
        order = a.choose(f"q{i}", RoutingInfo([*SYSTEM, i + 1]), reps)
        assert order[0] == first[0]
        a.routed(f"q{i}", order[0])
        a.completed(f"q{i}")
    assert a.num_routed == {first[0]: 4}


def test_concurrent_choices_see_each_other_before_the_router_confirms():
    """Ray Serve confirms a route after a round trip; requests chosen meanwhile must
    already count the earlier ones, or a burst lands on one replica."""
    a = PolicyAdapter("least_loaded")
    reps = [("r0", report()), ("r1", report())]
    picks = [a.choose(f"q{i}", RoutingInfo([i] * 20), reps)[0] for i in range(4)]
    assert sorted(picks) == ["r0", "r0", "r1", "r1"]
    assert a.policy.outstanding == {"r0": 2, "r1": 2}


def test_routed_elsewhere_moves_the_request():
    """The first choice was full and Ray Serve took the next rank: the load follows."""
    a = PolicyAdapter("least_loaded")
    reps = [("r0", report()), ("r1", report())]
    order = a.choose("q", RoutingInfo([1, 2, 3]), reps)
    a.routed("q", order[1])
    assert a.policy.outstanding == {order[0]: 0, order[1]: 1}
    a.completed("q")
    assert a.policy.outstanding == {order[0]: 0, order[1]: 0}
    assert a.requests == {} and a.routed_to == {}


def test_a_retry_does_not_count_twice():
    a = PolicyAdapter("least_loaded")
    reps = [("r0", report()), ("r1", report())]
    a.choose("q", RoutingInfo([1]), reps)
    a.choose("q", RoutingInfo([1]), reps)  # the router retried: no replica had room
    assert sum(a.policy.outstanding.values()) == 1


def test_reports_drive_the_load():
    a = PolicyAdapter("least_loaded")
    busy = report(running=5, waiting=3)
    assert a.choose("q", RoutingInfo([1]), [("r0", busy), ("r1", report())])[0] == "r1"
    assert a.policy.stats["r0"].num_waiting == 3
    # The same report object again is not re-applied (reports repeat between polls).
    a.policy.stats["r0"].num_waiting = 99
    a.observe("r0", busy)
    assert a.policy.stats["r0"].num_waiting == 99


def test_a_report_trims_the_cache_guess():
    a = PolicyAdapter("cache_aware")
    a.choose("q", RoutingInfo([*SYSTEM, 1]), [("r0", report())])
    assert len(a.policy.blocks["r0"]) == 4
    a.observe("r0", report(num_cached_blocks=0))  # the replica evicted everything
    assert len(a.policy.blocks["r0"]) == 0


def test_a_dead_replica_is_forgotten_and_never_chosen():
    a = PolicyAdapter("cache_aware")
    reps = [("r0", report()), ("r1", report())]
    order = a.choose("q", RoutingInfo([*SYSTEM, 1]), reps)
    a.routed("q", order[0])
    dead = order[0]
    a.remove_replica(dead)
    assert dead not in a.policy.outstanding and dead not in a.policy.blocks
    a.completed("q")  # its in-flight request ends (failed): nothing left to undo
    live = [r for r in reps if r[0] != dead]
    assert a.choose("q2", RoutingInfo([*SYSTEM, 2]), live) == [live[0][0]]


def test_set_replicas_drops_the_ones_gone():
    a = PolicyAdapter("round_robin")
    a.choose("q", RoutingInfo([1]), [("r0", report()), ("r1", report())])
    a.set_replicas(["r1"])
    assert set(a.reports) == {"r1"}


def test_requests_never_routed_are_not_kept_forever(monkeypatch):
    import iterserve.cluster.adapter as adapter_module

    monkeypatch.setattr(adapter_module, "MAX_TRACKED_REQUESTS", 16)
    a = PolicyAdapter("least_loaded")
    a.choose("kept", RoutingInfo([1]), [("r0", report())])  # routed: kept
    for i in range(40):  # chosen with no candidate, never routed (cancelled)
        a.choose(f"gone-{i}", RoutingInfo([i]), [])
        a.view(f"gone-{i}", RoutingInfo([i]))
    assert len(a.requests) <= 16 and "kept" in a.requests


def test_no_prompt_no_candidates():
    a = PolicyAdapter("cache_aware")
    assert a.choose("q", None, []) == []
    assert a.choose("q", None, [("r0", None)]) == ["r0"]


def test_bad_policy_name():
    with pytest.raises(ValueError, match="router_policy"):
        PolicyAdapter("nearest")


def test_single_replica_serve_never_imports_ray(tmp_path):
    """--data-parallel-size 1 (the default) is today's path: the engine and the app are
    built in this process (uvicorn.run stubbed out), and Ray is never imported."""
    from tests.model.helpers import make_checkpoint

    make_checkpoint(tmp_path, "llama")
    code = (
        "import sys, uvicorn\n"
        "served = []\n"
        "uvicorn.run = lambda app, **kw: served.append(app)\n"
        "from iterserve.entrypoints.cli import main\n"
        f"rc = main(['serve', '--model', {str(tmp_path)!r}, '--device', 'cpu', '-dp', '1',\n"
        "           '--num-gpu-blocks', '16', '--max-model-len', '128'])\n"
        "assert rc == 0 and served, 'the app was not built'\n"
        "assert 'ray' not in sys.modules, 'ray was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
