"""Speculative decoding in the scheduler: drafts in the leftover budget with lookahead
blocks, the accepted prefix kept, the rejected tail's blocks given back, and the KV a
fake model writes always matching the tokens (so no rejected token reaches the prefix
cache), under random workloads with every scheduler feature on."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iterserve.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from iterserve.core.kv_groups import make_kv_cache_groups
from iterserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from iterserve.core.request import RequestStatus
from iterserve.core.scheduler import Scheduler
from iterserve.core.slo import AdmissionRefused

from .helpers import EOS, make_request

PREFIXES = [[11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 23, 24]]


def spec_scheduler(k: int = 3, *, num_blocks: int = 64, block_size: int = 4,
                   max_num_batched_tokens: int = 64, max_num_seqs: int = 8,
                   adaptive: bool = False, swap_space: int = 0, enable_prefix_caching=True,
                   kv_cache_groups=None, **sched_kw) -> Scheduler:
    cache = CacheConfig(block_size=block_size, num_gpu_blocks=num_blocks,
                        swap_space=swap_space, enable_prefix_caching=enable_prefix_caching)
    sched = SchedulerConfig(max_num_seqs=max_num_seqs,
                            max_num_batched_tokens=max_num_batched_tokens,
                            max_model_len=128, **sched_kw)
    spec = SpeculativeConfig("ngram", k, adaptive=adaptive)
    return Scheduler(sched, cache, spec, kv_cache_groups)


class FakeKV:
    """What a model would have written: slot -> token id, device and host. With KV cache
    groups (``windows``: each group's window, None for global), each group's table is
    written, and read back as far as its window reaches."""

    def __init__(self, block_size: int, windows: list[int | None] | None = None) -> None:
        self.bs = block_size
        self.windows = windows or [None]
        self.dev: dict[int, int] = {}
        self.host: dict[int, int] = {}

    def apply_swaps(self, out: SchedulerOutput) -> None:
        bs = self.bs
        for d, h in out.blocks_to_swap_out:
            for i in range(bs):
                if d * bs + i in self.dev:
                    self.host[h * bs + i] = self.dev[d * bs + i]
        for h, d in out.blocks_to_swap_in:
            for i in range(bs):
                if h * bs + i in self.host:
                    self.dev[d * bs + i] = self.host[h * bs + i]

    def run(self, out: SchedulerOutput) -> None:
        """Check every computed position holds its token, then write this step's."""
        bs = self.bs
        spec = out.scheduled_spec_decode_tokens
        for req, n, c in zip(out.scheduled_requests, out.num_scheduled_tokens,
                             out.num_computed_tokens):
            drafts = spec.get(req.request_id, [])
            toks = req.all_token_ids[c:c + n] if not drafts else req.all_token_ids[c:] + drafts
            assert len(toks) == n
            hybrid = len(self.windows) > 1  # then block 0 is the null block: never touched
            for g, w in enumerate(self.windows):
                table = req.block_ids if g == 0 else req.block_tables[g]
                for p in range(0 if w is None else max(0, c - w + 1), c):
                    assert not hybrid or table[p // bs] != 0, (req, g, p)
                    slot = table[p // bs] * bs + p % bs
                    assert self.dev.get(slot) == req.all_token_ids[p], (req, g, p)
                for i, t in enumerate(toks):
                    p = c + i
                    assert not hybrid or table[p // bs] != 0, (req, g, p)
                    self.dev[table[p // bs] * bs + p % bs] = t


def verify_fake(out: SchedulerOutput, rng: random.Random, eos_rate: float = 0.05
                ) -> ModelRunnerOutput:
    """A fake verifier: a random accepted prefix of each request's drafts, then a token."""
    sampled: dict[str, int] = {}
    accepted: dict[str, list[int]] = {}
    spec = out.scheduled_spec_decode_tokens
    for req, n, c in zip(out.scheduled_requests, out.num_scheduled_tokens,
                         out.num_computed_tokens):
        drafts = spec.get(req.request_id)
        if drafts:
            assert c + n == req.num_tokens + len(drafts)
            accepted[req.request_id] = drafts[: rng.randint(0, len(drafts))]
        elif c + n != req.num_tokens:
            continue
        sampled[req.request_id] = EOS if rng.random() < eos_rate else rng.randint(1, 50)
    return ModelRunnerOutput(sampled, accepted_draft_token_ids=accepted)


def propose_fake(sched: Scheduler, rng: random.Random) -> None:
    assert sched.spec is not None
    for req, k in sched.spec.plan(sched.running):
        # Mostly the request's own recent tokens (as n-gram drafts would be), sometimes junk.
        src = req.all_token_ids
        req.spec_token_ids = [src[rng.randrange(len(src))] if rng.random() < 0.7
                              else rng.randint(1, 50) for _ in range(rng.randint(0, k))]


def check_spec_state(sched: Scheduler) -> None:
    bs = sched.block_size
    for req in sched.running:
        # KV is valid for accepted tokens only, and only computed blocks are cached.
        assert req.num_computed_tokens < req.num_tokens or req.num_computed_tokens == 0
        assert req.num_cached_blocks * bs <= req.num_computed_tokens
        # No lookahead block outlives its step.
        assert len(req.block_ids) <= -(-req.num_computed_tokens // bs), req


def test_drafts_use_leftover_budget_and_lookahead_blocks():
    s = spec_scheduler(3, max_num_batched_tokens=16)
    s.add_request(make_request("a", 5, max_tokens=20))
    out = s.schedule(0.0)
    s.update(out, ModelRunnerOutput({"a": 9}), 0.0)
    req = s.running[0]
    req.spec_token_ids = [1, 2, 3]
    out = s.schedule(1.0)
    assert out.num_scheduled_tokens == [4] and out.num_spec_tokens == 3
    assert out.scheduled_spec_decode_tokens == {"a": [1, 2, 3]}
    assert len(req.block_ids) * 4 >= 5 + 4  # positions 5..8 have slots
    assert out.total_num_scheduled_tokens == 4 and out.num_decode_tokens == 1
    outs = s.update(out, ModelRunnerOutput({"a": 7}, accepted_draft_token_ids={"a": [1, 2]}),
                    1.0)
    assert req.output_token_ids == [9, 1, 2, 7]
    assert req.num_computed_tokens == req.num_tokens - 1 == 8
    assert [o.new_token_ids for o in outs] == [[1, 2, 7]]
    assert len(req.block_ids) == 2  # ceil(8 / 4): the lookahead block for position 9 is back
    st = s.spec.stats
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens) == (1, 3, 2)
    assert st.accepted_per_pos == [1, 1, 0]
    s.check_invariants()


def test_drafts_never_displace_real_work_or_pass_max_tokens():
    s = spec_scheduler(4, max_num_batched_tokens=8)
    s.add_request(make_request("a", 3, max_tokens=3))
    s.update(s.schedule(0.0), ModelRunnerOutput({"a": 9}), 0.0)
    s.running[0].spec_token_ids = [1, 2, 3, 4]
    s.add_request(make_request("b", 6, max_tokens=4))
    out = s.schedule(1.0)
    # b's 6-token prefill comes first; a decodes with 1 draft (budget 8 = 6 + 1 + 1),
    # and never more than its max_tokens allows (2 left: 1 draft + the bonus).
    assert dict(zip([r.request_id for r in out.scheduled_requests],
                    out.num_scheduled_tokens)) == {"a": 2, "b": 6}
    outs = s.update(out, ModelRunnerOutput({"a": 5, "b": 8},
                                           accepted_draft_token_ids={"a": [1]}), 1.0)
    final = {o.request_id: o for o in outs}
    assert final["a"].new_token_ids == [1, 5] and final["a"].finish_reason == "length"
    s.check_invariants()


def test_stop_token_inside_accepted_drafts_ends_there():
    s = spec_scheduler(3)
    s.add_request(make_request("a", 4, max_tokens=20, ignore_eos=False))
    s.update(s.schedule(0.0), ModelRunnerOutput({"a": 9}), 0.0)
    s.running[0].spec_token_ids = [5, EOS, 6]
    out = s.schedule(1.0)
    outs = s.update(out, ModelRunnerOutput({"a": 7}, accepted_draft_token_ids={"a": [5, EOS, 6]}),
                    1.0)
    (o,) = outs
    assert o.new_token_ids == [5, EOS] and o.finish_reason == "stop"
    assert not s.requests and s.kv.num_free_blocks == s.kv.num_blocks


def test_no_blocks_for_lookahead_means_no_drafts():
    s = spec_scheduler(3, num_blocks=3, block_size=4, enable_prefix_caching=False)
    s.add_request(make_request("hog", 7, max_tokens=1))  # 2 blocks
    s.add_request(make_request("b", 3, max_tokens=10))  # 1 block
    s.update(s.schedule(0.0), ModelRunnerOutput({"hog": 1, "b": 2}), 0.0)
    s.add_request(make_request("c", 7, max_tokens=2))  # takes the hog's 2 blocks back
    b = s.requests["b"]
    b.spec_token_ids = [1, 2, 3]
    out = s.schedule(1.0)
    # b's next slot (position 3) is in its block; drafts would need a 4th block.
    assert s.kv.num_free_blocks == 0
    assert dict(zip([r.request_id for r in out.scheduled_requests],
                    out.num_scheduled_tokens)) == {"b": 1, "c": 7}
    assert out.scheduled_spec_decode_tokens == {}
    s.check_invariants()


def test_preemption_clears_drafts():
    s = spec_scheduler(2)
    s.add_request(make_request("a", 4, max_tokens=10))
    s.update(s.schedule(0.0), ModelRunnerOutput({"a": 9}), 0.0)
    req = s.running[0]
    req.spec_token_ids = [1, 2]
    out = s.schedule(1.0)
    s.preempt(req, out)
    assert req.spec_token_ids == [] and req.status is RequestStatus.PREEMPTED


spec_configs = st.fixed_dictionaries(
    {
        "k": st.integers(1, 5),
        "num_blocks": st.integers(8, 40),
        "block_size": st.sampled_from([1, 2, 4, 8]),
        "max_num_seqs": st.integers(1, 8),
        "max_num_batched_tokens": st.integers(8, 64),
        "enable_prefix_caching": st.booleans(),
        "enable_chunked_prefill": st.booleans(),
        "scheduling_policy": st.sampled_from(["fcfs", "priority", "fair", "slo"]),
        "preemption_mode": st.sampled_from(["recompute", "swap"]),
        "swap_space": st.integers(0, 64),
        "adaptive": st.booleans(),
        # A hybrid model's groups (one global, one local layer), or one global group.
        "sliding_window": st.sampled_from([None, None, 1, 3, 8]),
    }
)


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cfg=spec_configs, seed=st.integers(0, 2**32 - 1), num_steps=st.integers(20, 120))
def test_invariants_hold_with_speculation(cfg, seed, num_steps):
    rng = random.Random(seed)
    if not cfg["enable_chunked_prefill"]:
        cfg["max_num_batched_tokens"] = 128
    k = cfg.pop("k")
    window = cfg.pop("sliding_window")
    groups = None if window is None else make_kv_cache_groups([window, None])
    s = spec_scheduler(k, kv_cache_groups=groups, **cfg)
    kv = FakeKV(cfg["block_size"], None if groups is None else
                [g.sliding_window for g in groups])
    capacity = s.kv_capacity_tokens
    accepted: set[str] = set()
    finished: Counter[str] = Counter()
    emitted: Counter[str] = Counter()
    max_tokens: dict[str, int] = {}
    next_id = 0
    now = 0.0

    def record(outputs):
        for o in outputs:
            assert o.request_id in accepted
            emitted[o.request_id] += len(o.new_token_ids)
            if o.finish_reason is not None:
                finished[o.request_id] += 1
                assert finished[o.request_id] == 1
            assert emitted[o.request_id] <= max_tokens[o.request_id]

    def step():
        nonlocal now
        propose_fake(s, rng)
        out = s.schedule(now)
        assert out.total_num_scheduled_tokens <= cfg["max_num_batched_tokens"]
        assert sum(out.num_scheduled_tokens) == out.total_num_scheduled_tokens
        assert out.num_spec_tokens == sum(map(len, out.scheduled_spec_decode_tokens.values()))
        for req, n, c in zip(out.scheduled_requests, out.num_scheduled_tokens,
                             out.num_computed_tokens):
            assert c + n <= len(req.block_ids) * cfg["block_size"]
            drafts = out.scheduled_spec_decode_tokens.get(req.request_id, [])
            assert c + n <= req.num_tokens + len(drafts)
            assert req.num_tokens + len(drafts) < req.max_num_tokens or not drafts
        kv.apply_swaps(out)
        kv.run(out)
        failed = []
        if out.scheduled_requests and rng.random() < 0.02:
            failed = [rng.choice(out.scheduled_requests).request_id]
        runner_out = verify_fake(out, rng)
        runner_out.failed_req_ids = failed
        record(s.update(out, runner_out, now))
        s.check_invariants()
        check_spec_state(s)
        now += 0.01

    for _ in range(num_steps):
        action = rng.random()
        if action < 0.35:
            for _ in range(rng.randint(1, 3)):
                rid = f"r{next_id}"
                next_id += 1
                body = rng.randint(1, 30)
                prompt = [rng.randint(1, 50) for _ in range(body)]
                if rng.random() < 0.5:
                    prompt = rng.choice(PREFIXES) + prompt
                req = make_request(rid, prompt, max_tokens=rng.randint(1, 40), arrival=now,
                                   ignore_eos=rng.random() < 0.5)
                try:
                    s.add_request(req)
                except (ValueError, AdmissionRefused):
                    assert len(prompt) + req.sampling_params.max_tokens - 1 > min(capacity, 127)
                    continue
                accepted.add(rid)
                max_tokens[rid] = req.sampling_params.max_tokens
        elif action < 0.42 and s.requests:
            victims = rng.sample(sorted(s.requests), k=min(2, len(s.requests)))
            record(s.abort_requests(victims, now))
            s.check_invariants()
        step()

    for _ in range(20_000):
        if not s.has_unfinished_requests():
            break
        step()
    assert not s.has_unfinished_requests(), "requests stuck"
    assert set(finished) == accepted
    assert s.kv.num_free_blocks == s.kv.num_blocks
    assert s.kv.host_pool.num_free_blocks == s.kv.host_pool.num_blocks
    st_ = s.spec.stats
    assert st_.num_accepted_tokens <= st_.num_draft_tokens
    assert sum(st_.accepted_per_pos) == st_.num_accepted_tokens


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_speculation_under_memory_pressure_finishes_everything(mode):
    rng = random.Random(1)
    s = spec_scheduler(4, num_blocks=12, block_size=2, max_num_batched_tokens=24,
                       preemption_mode=mode, swap_space=40)
    kv = FakeKV(2)
    for i in range(6):
        s.add_request(make_request(f"r{i}", 5 + i, max_tokens=12))
    steps = 0
    while s.has_unfinished_requests():
        propose_fake(s, rng)
        out = s.schedule(float(steps))
        kv.apply_swaps(out)
        kv.run(out)
        s.update(out, verify_fake(out, rng, eos_rate=0.0), float(steps))
        s.check_invariants()
        check_spec_state(s)
        steps += 1
        assert steps < 2000
    assert s.num_preemptions > 0 and s.spec.stats.num_accepted_tokens > 0


def test_executor_that_ignores_drafts_loses_nothing():
    s = spec_scheduler(3)
    s.add_request(make_request("a", 4, max_tokens=6))
    s.update(s.schedule(0.0), ModelRunnerOutput({"a": 9}), 0.0)
    req = s.running[0]
    req.spec_token_ids = [1, 2, 3]
    out = s.schedule(1.0)
    assert out.num_spec_tokens == 3
    assert s.update(out, ModelRunnerOutput({}), 1.0) == []
    assert req.num_computed_tokens == 4 and req.num_tokens == 5 and len(req.block_ids) == 1
    check_spec_state(s)
    out = s.schedule(2.0)  # no drafts this time: a plain decode of the same token
    assert out.num_scheduled_tokens == [1] and out.num_computed_tokens == [4]
    s.check_invariants()
