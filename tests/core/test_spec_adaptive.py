"""The load-adaptive K (core/spec_decode.py): acceptance EWMA, the batch's cost ratio,
speculation off for large batches, probes, eligibility."""

from __future__ import annotations

import math

import pytest

from iterserve.config import SpeculativeConfig
from iterserve.core.sampling_params import StructuredOutputsParams
from iterserve.core.spec_decode import PROBE_INTERVAL, SpecDecodeController, eligible

from .helpers import make_request

# A CPU-like step: 10 ms a step, 1 ms a token of compute, 0.2 ms a decoding sequence.
CPU_STEP = (10e-3, 1e-3, 0.2e-3, 0.0)


def decoding(rid: str, *, max_tokens: int = 50, **params):
    req = make_request(rid, 8, max_tokens=max_tokens, **params)
    req.all_token_ids.append(5)  # one output token, not yet computed
    req.num_computed_tokens = 8
    return req


def controller(k: int = 4, **kw) -> SpecDecodeController:
    return SpecDecodeController(SpeculativeConfig("ngram", k, **kw), CPU_STEP)


def test_cost_ratio_follows_the_step_time_model():
    c = controller()
    one = [decoding("a")]
    assert c.cost_ratio(one) == pytest.approx(1e-3 / (10e-3 + 0.2e-3), rel=1e-6)
    many = [decoding(f"r{i}") for i in range(16)]
    assert c.cost_ratio(many) == pytest.approx(16e-3 / (10e-3 + 16 * 0.2e-3), rel=1e-6)
    assert c.cost_ratio([]) == 1.0


def test_k_shrinks_with_batch_and_turns_off():
    c = controller(8, initial_acceptance_rate=0.8)
    small = c.plan([decoding("a")])
    r = c.last_cost_ratio
    assert [k for _, k in small] == [min(8, int(math.log(r) / math.log(0.8)))]
    assert small[0][1] == 8  # r ~ 0.1: deep speculation pays
    four = c.plan([decoding(f"r{i}") for i in range(4)])
    assert all(0 < k < 8 for _, k in four)
    assert c.plan([decoding(f"b{i}") for i in range(16)]) == []  # r > 1: off for everyone


def test_acceptance_ewma_moves_k():
    c = controller(6, initial_acceptance_rate=0.5, acceptance_ewma_alpha=0.5)
    req = decoding("a")
    k0 = c.num_drafts_for("a", 0.05)
    for _ in range(6):
        c.observe("a", 6, 6)
    assert c.acceptance_rate("a") > 0.9
    assert c.num_drafts_for("a", 0.05) == 6 > k0
    for _ in range(10):
        c.observe("a", 6, 0)
    assert c.acceptance_rate("a") < 0.05
    # Rejected everything: no drafts, but a one-draft probe every PROBE_INTERVAL steps.
    ks = [c.num_drafts_for("a", 0.05) for _ in range(PROBE_INTERVAL)]
    assert ks[:-1] == [0] * (PROBE_INTERVAL - 1) and ks[-1] == 1
    c.on_finished(req)
    assert c.acceptance_rate("a") == 0.5 and c.pop_finished() == [req]


def test_acceptance_counts_only_reached_drafts():
    c = controller(4, initial_acceptance_rate=0.5, acceptance_ewma_alpha=1.0)
    c.observe("a", 4, 2)  # 2 accepted, the third rejected, the fourth never reached
    assert c.acceptance_rate("a") == pytest.approx(2 / 3)
    c.observe("a", 4, 4)
    assert c.acceptance_rate("a") == 1.0


def test_fixed_k_and_disable_by_batch_size():
    c = controller(3, adaptive=False, disable_by_batch_size=2)
    reqs = [decoding("a"), decoding("b")]
    assert [k for _, k in c.plan(reqs)] == [3, 3]
    assert c.plan([*reqs, decoding("c")]) == []


def test_drafts_stop_at_max_tokens():
    c = controller(5, adaptive=False)
    req = decoding("a", max_tokens=3)  # 1 output so far, 2 to go: 1 draft + the bonus
    assert c.plan([req]) == [(req, 1)]
    assert c.plan([decoding("b", max_tokens=1)]) == []


@pytest.mark.parametrize("params, ok", [
    ({}, True),
    ({"temperature": 0.8, "seed": 3}, True),
    ({"logprobs": 2, "logit_bias": {3: 1.0}}, True),
    ({"repetition_penalty": 1.2, "frequency_penalty": 0.5}, True),
    ({"bad_words_token_ids": [[4, 5]]}, False),
    ({"min_tokens": 5}, True),
    ({"structured_outputs": StructuredOutputsParams(regex="a+")}, False),
])
def test_eligibility(params, ok):
    assert eligible(decoding("a", **params)) is ok


def test_prefills_are_not_eligible():
    req = make_request("p", 8, max_tokens=5)
    assert not eligible(req)
    c = controller(adaptive=False)
    assert c.plan([req]) == []
