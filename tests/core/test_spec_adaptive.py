"""The load-adaptive K (core/spec_decode.py): acceptance EWMA, the step-cost fallback,
speculation off for large batches, probes, eligibility."""

from __future__ import annotations

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


def test_step_seconds_fall_back_to_the_linear_model():
    c = controller()
    assert c.step_seconds(1, 0, 0, 9) == pytest.approx(10e-3 + 0.2e-3, rel=1e-6)
    assert c.step_seconds(16, 3, 0, 200) == pytest.approx(10e-3 + 3e-3 + 16 * 0.2e-3, rel=1e-6)
    c.observe_cost(0, 4, 2e-3)  # measured: the table answers steps without prefill
    assert c.step_seconds(4, 0, 0, 40) == pytest.approx(2e-3)
    assert c.step_seconds(4, 0, 5, 40) == pytest.approx(10e-3 + 5e-3 + 4 * 0.2e-3, rel=1e-6)


def test_k_shrinks_with_batch_and_turns_off():
    c = controller(8, initial_acceptance_rate=0.8)
    (_, k1), = c.plan([decoding("a")])
    assert k1 >= 5  # 1 ms a row against a 10 ms step: deep speculation pays
    four = c.plan([decoding(f"r{i}") for i in range(4)])
    assert all(0 < k < k1 for _, k in four)
    assert c.plan([decoding(f"b{i}") for i in range(16)]) == []  # rows cost more than a**j


def test_acceptance_ewma_moves_k():
    c = controller(6, initial_acceptance_rate=0.5, acceptance_ewma_alpha=0.5)
    req = decoding("a")
    (_, k0), = c.plan([req])
    for _ in range(6):
        c.observe("a", 6, 6)
    assert c.acceptance_rate("a") > 0.9
    assert c.plan([req]) == [(req, 6)] and k0 < 6
    for _ in range(10):
        c.observe("a", 6, 0)
    assert c.acceptance_rate("a") < 0.05
    # Rejected everything: no drafts, but a one-draft probe every PROBE_INTERVAL steps.
    ks = [sum(k for _, k in c.plan([req])) for _ in range(PROBE_INTERVAL)]
    assert ks[:-1] == [0] * (PROBE_INTERVAL - 1) and ks[-1] == 1
    c.on_finished(req)
    assert c.acceptance_rate("a") == 0.5 and c.pop_finished() == [req]


def test_probes_wait_when_they_would_cost_the_step():
    c = controller(4, initial_acceptance_rate=0.01)
    reqs = [decoding(f"r{i}") for i in range(32)]
    for r in range(1, 80):  # a batched path where every row costs the average
        c.observe_cost(0, r, 1e-3 * r)
    assert all(c.plan(reqs) == [] for _ in range(2 * PROBE_INTERVAL))


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
