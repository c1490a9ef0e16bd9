"""The multi-turn workload: prompts extend each other exactly, tenants share system
prompts, one seed gives one workload, and bench serve sends the same prompts."""

from __future__ import annotations

import itertools
import json
from collections import defaultdict

import pytest

from iterserve.bench.datasets import build_requests
from iterserve.measure.workload import load_trace
from iterserve.measure.workload_multi_turn import MultiTurnConfig, make_multi_turn_workload

CFG = MultiTurnConfig(num_tenants=3, system_prompt_len=100, turns="uniform:2:5",
                      user_len="uniform:5:40", output_len="uniform:5:30", think_time_s=2.0)


def _sessions(wl):
    by_session = defaultdict(list)
    for r in wl.requests:
        by_session[r.session_id].append(r)
    return by_session


def test_each_turn_extends_the_previous_prompt_and_answer():
    wl = make_multi_turn_workload(300, CFG, rate=5.0, seed=1)
    assert len(wl) == 300
    sessions = _sessions(wl)
    assert len(sessions) == wl.meta["num_sessions"] > 50
    num_checked = 0
    for turns in sessions.values():
        assert len({t.tenant for t in turns}) == 1
        for prev, cur in itertools.pairwise(turns):
            assert cur.arrival_time > prev.arrival_time
            ids, prev_ids = cur.prompt_token_ids, prev.prompt_token_ids
            assert ids is not None and prev_ids is not None
            # previous prompt + its answer (output_len tokens) + a new message of >= 5
            assert ids[: len(prev_ids)] == prev_ids
            assert len(ids) - len(prev_ids) - prev.output_len >= 5
            num_checked += 1
    assert num_checked > 100
    for r in wl.requests:
        assert r.prompt_len == len(r.prompt_token_ids)
        assert min(r.prompt_token_ids) >= 8  # clear of special ids (a simulated EOS is 0)
    times = [r.arrival_time for r in wl.requests]
    assert times == sorted(times) and times[0] == 0.0


def test_answers_are_the_next_prompts_tokens():
    # Two turns of one session: turn 2 carries turn 1's answer at a fixed place.
    cfg = MultiTurnConfig(num_tenants=1, system_prompt_len=16, turns="fixed:2",
                          user_len="fixed:8", output_len="fixed:12", think_time_s=0.0)
    wl = make_multi_turn_workload(2, cfg, rate=1.0, seed=0)
    first, second = wl.requests
    assert first.session_id == second.session_id
    assert first.prompt_len == 24 and second.prompt_len == 24 + 12 + 8
    # With no think time the next turn comes after the estimated answer time.
    assert second.arrival_time == pytest.approx(12 * cfg.est_tpot_s)


def test_tenants_share_their_system_prompt_and_nothing_else():
    wl = make_multi_turn_workload(200, CFG, rate=5.0, seed=2)
    heads = defaultdict(set)
    for r in wl.requests:
        heads[r.tenant].add(tuple(r.prompt_token_ids[:100]))
    assert len(heads) == 3
    assert all(len(h) == 1 for h in heads.values())  # one system prompt per tenant
    assert len({next(iter(h)) for h in heads.values()}) == 3
    # After the system prompt, sessions differ.
    firsts = [t[0] for t in _sessions(wl).values()]
    assert len({tuple(r.prompt_token_ids[:110]) for r in firsts}) > len(heads)


def test_seeded():
    a = make_multi_turn_workload(100, CFG, rate=5.0, seed=7)
    b = make_multi_turn_workload(100, CFG, rate=5.0, seed=7)
    c = make_multi_turn_workload(100, CFG, rate=5.0, seed=8)
    assert a.requests == b.requests
    assert a.requests != c.requests


def test_tenant_skew_makes_a_hot_tenant():
    skewed = MultiTurnConfig(num_tenants=8, system_prompt_len=8, tenant_skew=2.0)
    wl = make_multi_turn_workload(2000, skewed, rate=5.0, seed=0)
    counts = defaultdict(int)
    for r in wl.requests:
        counts[r.tenant] += 1
    assert counts["tenant-0"] > 0.4 * len(wl) > counts["tenant-7"]


@pytest.mark.parametrize("field,value", [("num_tenants", 0), ("turns", "trace"),
                                         ("user_len", "uniform:9:3"), ("think_time_s", -1.0)])
def test_bad_config_names_the_field(field, value):
    cfg = MultiTurnConfig(**{field: value})
    with pytest.raises(ValueError, match=field):
        make_multi_turn_workload(10, cfg)


def test_jsonl_round_trip_keeps_prompts_and_sessions(tmp_path):
    wl = make_multi_turn_workload(40, CFG, rate=5.0, seed=3)
    path = tmp_path / "mt.jsonl"
    wl.to_jsonl(path)
    assert "session_id" in json.loads(path.read_text().splitlines()[0])
    back = load_trace(path)
    assert [r.prompt_token_ids for r in back] == [r.prompt_token_ids for r in wl.requests]
    assert [r.session_id for r in back] == [r.session_id for r in wl.requests]


def test_bench_dataset_sends_the_same_prompts_at_their_times():
    cfg = MultiTurnConfig(num_tenants=2, system_prompt_len=64, vocab_size=256)
    reqs = build_requests("multi-turn", 50, seed=4, multi_turn=cfg, multi_turn_rate=3.0)
    wl = make_multi_turn_workload(50, cfg, rate=3.0, seed=4)
    assert [r.prompt for r in reqs] == [s.prompt_token_ids for s in wl.requests]
    assert [r.arrival_time for r in reqs] == [s.arrival_time for s in wl.requests]
    assert [r.expected_output_len for r in reqs] == [s.output_len for s in wl.requests]
    assert [r.session_id for r in reqs] == [s.session_id for s in wl.requests]
    assert max(max(r.prompt) for r in reqs) < 256
