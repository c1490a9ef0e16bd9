"""The measured-cost rule of the adaptive K (core/spec_cost.py, SpecDecodeController.
choose / plan) on synthetic cost tables: the fused decoder's row cap and its cliff, the
proposer's cost, acceptance."""

from __future__ import annotations

import pytest

from iterserve.config import SpeculativeConfig
from iterserve.core.spec_cost import SLOPE_SHARE, TRUST_SAMPLES, DraftCost, StepCostTable
from iterserve.core.spec_decode import SpecDecodeController

from .helpers import make_request

CAP = 8


def synthetic_seconds(rows: int) -> float:
    """A small model on a CPU: the lone-token path, the fused few-row decoder (a row
    costs little) up to CAP rows, then the batched path's per-step overhead."""
    if rows == 1:
        return 0.30e-3
    if rows <= CAP:
        return 0.35e-3 + 0.02e-3 * rows
    return 2.0e-3 + 0.2e-3 * rows


def controller(k: int, acceptance: float, rows: int = 300) -> SpecDecodeController:
    c = SpecDecodeController(SpeculativeConfig("ngram", k, initial_acceptance_rate=acceptance))
    c.set_fused_rows(CAP)
    for r in range(1, rows + 1):
        c.observe_cost(0, r, synthetic_seconds(r))
    return c


def decoding(rid: str, max_tokens: int = 100):
    req = make_request(rid, 8, max_tokens=max_tokens)
    req.all_token_ids.append(5)
    req.num_computed_tokens = 8
    return req


def batch(n: int):
    return [decoding(f"r{i}") for i in range(n)]


def test_deep_k_at_batch_one_with_high_acceptance():
    c = controller(7, 0.95)
    (_, k), = c.plan(batch(1))
    assert k == 7  # 8 rows: still the fused decoder, each row almost free


def test_k_stays_within_the_fused_row_cap_when_the_cliff_matters():
    c = controller(4, 0.8)
    plan = c.plan(batch(4))
    rows = 4 + sum(k for _, k in plan)
    assert plan and rows <= CAP  # 4 x (1 + 4) = 20 rows would pay the cliff
    # Without the cliff (a batched path as cheap per row as the fused one) it goes deep.
    flat = SpecDecodeController(SpeculativeConfig("ngram", 4, initial_acceptance_rate=0.8))
    for r in range(1, 40):
        flat.observe_cost(0, r, 0.35e-3 + 0.02e-3 * r)
    assert 4 + sum(k for _, k in flat.plan(batch(4))) > CAP


def test_no_drafts_when_drafting_costs_more_than_it_yields():
    c = controller(4, 0.6)
    c.observe_draft_cost(1, 5e-2)  # the first call (state building) is not counted
    c.observe_draft_cost(1, 1e-3)  # a proposer three times the step
    assert c.plan(batch(1)) == [] and c.last_num_drafts == 0
    assert controller(4, 0.02).plan(batch(2)) == []  # nothing gets accepted
    assert controller(4, 0.6).plan(batch(64)) == []  # saturated: rows cost more than a**j


def test_the_plan_maximises_expected_tokens_per_second():
    c = controller(4, 0.7)
    reqs = batch(2)
    ks = [k for _, k in c.plan(reqs)]

    def rate(n: int) -> float:
        gain = sum(0.7 ** (j + 1) for j in range(n // 2)) * 2 + (0.7 ** (n // 2 + 1)
                                                                  if n % 2 else 0.0)
        return (2 + gain) / synthetic_seconds(2 + n)

    best = max(range(9), key=rate)
    assert sum(ks) == best and max(ks) - min(ks) <= 1
    assert c.last_rate == pytest.approx(rate(best))


def test_low_acceptance_requests_get_fewer_drafts():
    c = controller(4, 0.6)
    good, bad = decoding("good"), decoding("bad")
    for _ in range(10):
        c.observe("good", 4, 4)
        c.observe("bad", 4, 0)
    ks = dict((r.request_id, k) for r, k in c.plan([good, bad]))
    assert ks.get("good", 0) >= 3 and "bad" not in ks


def test_misses_lower_a_requests_drafts():
    c = controller(4, 0.8)
    for _ in range(20):
        c.observe_proposal("r0", False)
    ks = {r.request_id: k for r, k in c.plan(batch(2))}
    assert ks.get("r0", 0) < ks["r1"]


def test_table_interpolates_within_a_regime_never_across_the_cap():
    t = StepCostTable(fused_rows=8)
    assert t.predict(3) is None
    t.observe(4, 1.0)
    t.observe(6, 1.2)
    t.observe(12, 5.0)
    assert t.predict(5) == pytest.approx(1.1)
    assert t.predict(8) == pytest.approx(1.4)  # the fused regime's slope, not 4 -> 12's
    assert t.predict(10) == pytest.approx(5.0 - 2 * SLOPE_SHARE * 5.0 / 12)
    # An unmeasured regime: above the measured ones by a small slope, below them (under
    # a cliff) in proportion to its rows, so that either gets tried and measured.
    assert t.predict(1) == pytest.approx(1.0 / 4)
    t.observe(20, 7.0)
    assert t.predict(30) == pytest.approx(7.0 + 10 * 2.0 / 8)
    t.observe(4, 100.0)  # a hiccup counts as OUTLIER times the average at most
    assert t.predict(4) == pytest.approx(1.2)


def test_draft_cost_is_per_request():
    d = DraftCost()
    d.observe(1, 1.0)  # the first call builds the proposer's state: not counted
    assert d.per_request == 0.0 and d.num_calls == 1
    d.observe(4, 2e-3)
    assert d.per_request == pytest.approx(5e-4)
    d.observe(0, 1.0)  # no requests: ignored
    assert d.num_calls == 2
    d.observe(1, 1.0)  # a later spike counts as OUTLIER times the average at most
    assert d.per_request < 1e-3


def test_an_expensive_first_proposal_does_not_switch_speculation_off_for_good():
    """The proposer's first call (an n-gram index over the whole prompt) can cost a
    hundred later calls; priced by it, drafting would stop and never be measured again."""
    c = controller(4, 0.6)
    c.observe_draft_cost(1, 5e-2)  # the first call: 50 ms
    assert c.plan(batch(1)) != []
    c.observe_draft_cost(1, 1e-5)
    assert c.plan(batch(1)) != []


def test_a_request_whose_proposer_often_finds_nothing_pays_only_for_its_hits():
    """Verify rows cost the step only when the proposer has a draft: a request with
    a 40% hit rate and good acceptance, on a CPU where 4 drafts double the step (the
    default model's: 0.28 ms for one row, 0.59 ms for five), still drafts. Priced as
    if every step verified, it would not (1.94 tokens / 0.59 ms < 1 / 0.28 ms)."""
    c = SpecDecodeController(SpeculativeConfig("ngram", 4, initial_acceptance_rate=0.8))
    c.set_fused_rows(32)
    for r in range(1, 33):
        c.observe_cost(0, r, 0.28e-3 + 0.0775e-3 * (r - 1))
    req = batch(1)
    for hit in [False, True] * 3 + [False, False]:
        c.observe_proposal(req[0].request_id, hit)
    assert c.hit_rate(req[0].request_id) == pytest.approx(0.4, abs=0.1)
    (_, k), = c.plan(req)
    assert k == 4


def test_steps_right_after_a_prefill_are_not_priced():
    """A prefill evicts the few-row path's weights from the caches: the next steps pay
    for reading them back (3x, then 1.8x on the default model). The first verify step
    of a request is one; priced by it, drafts would look unprofitable for good."""
    c = SpecDecodeController(SpeculativeConfig("ngram", 4, initial_acceptance_rate=0.8))
    c.set_fused_rows(32)
    c.observe_cost(200, 200, 11e-3)  # a prefill step
    c.observe_cost(0, 5, 1.19e-3)  # cold: the first verify step
    c.observe_cost(0, 1, 0.60e-3)  # still cold
    assert c.cost.seconds == {}
    c.observe_cost(0, 1, 0.34e-3)
    c.observe_cost(0, 5, 0.66e-3)
    assert c.cost.seconds == {1: 0.34e-3, 5: 0.66e-3}
    (_, k), = c.plan(batch(1))
    assert k == 4


def test_one_spike_does_not_price_larger_steps_out():
    """Row counts 2..6 well measured (about 0.1 ms a row), then one step of 7 rows
    met a spike (1.6 ms): extrapolated from 6 and 7, every larger step looked 0.6 ms a
    row dearer and was never tried again. Until it has TRUST_SAMPLES samples a row
    count is priced at no more than its regime's line through the trusted ones."""
    t = StepCostTable(fused_rows=32)
    for _ in range(TRUST_SAMPLES):
        for r in range(1, 7):
            t.observe(r, 0.35e-3 + 0.1e-3 * r)
    t.observe(7, 1.64e-3)
    assert t.predict(7) == pytest.approx(0.35e-3 + 0.7e-3)
    assert t.predict(10) == pytest.approx(0.35e-3 + 1.0e-3)
    for _ in range(TRUST_SAMPLES):
        t.observe(8, 1.64e-3)  # a row count that is that dear: trusted once confirmed
    assert t.predict(8) > 1.5e-3
