"""Speculative decoding in the simulator: the acceptance models, exact request lengths
through the production scheduler's verify path, and where speculation stops paying
under a roofline cost model."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from iterserve.config import CacheConfig, SchedulerConfig
from iterserve.config_speculative import parse_speculative_config
from iterserve.model.default_model import packaged_model_dir
from iterserve.sim.cost_model import get_hardware, get_model_spec, roofline_cost_model
from iterserve.sim.hardware import HardwareSpec
from iterserve.sim.simulator import Simulator, compute_metrics
from iterserve.sim.speculative import (
    AcceptanceModel,
    AcceptanceSampler,
    LoadPoint,
    break_even,
    format_points,
    sweep_loads,
)
from iterserve.sim.workload import make_workload


def configs(seqs: int = 256, blocks: int = 40000):
    sc = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=8192, max_model_len=4096)
    return sc, CacheConfig(block_size=16, num_gpu_blocks=blocks)


def spec(k: int = 4, adaptive: bool = False):
    cfg = parse_speculative_config({"method": "ngram", "num_speculative_tokens": k,
                                    "adaptive": adaptive})
    assert cfg is not None
    return cfg


def test_acceptance_models() -> None:
    m = AcceptanceModel.constant(0.5)
    assert m.expected_accepted(3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert m.mean_acceptance_length(3) == pytest.approx(1.875)
    fit = AcceptanceModel.from_mean_length(1.875, 3)
    assert fit.per_position[0] == pytest.approx(0.5, abs=1e-9)
    c = AcceptanceModel.from_counts(100, [80, 40, 10], num_steps=200)
    assert c.per_position == pytest.approx((0.8, 0.5, 0.25)) and c.draft_prob == 0.5
    p = AcceptanceModel.parse('{"per_position": [0.9, 0.7], "draft_prob": 0.8}', 4)
    assert p.rate(0) == 0.9 and p.rate(5) == 0.7 and p.draft_prob == 0.8
    assert AcceptanceModel.parse({"mean_acceptance_length": 2.0}, 2).per_position[0] == (
        pytest.approx(0.618, abs=1e-3))
    for bad in ('{"rate": 1.5}', '{"per_position": []}', '{"nope": 1}', "[1]",
                '{"mean_acceptance_length": 9}', "{"):
        with pytest.raises(ValueError, match="acceptance model"):
            AcceptanceModel.parse(bad, 4)
    # The sampler's draws follow the model.
    s = AcceptanceSampler(AcceptanceModel.constant(0.7, seed=3))
    mean = sum(s.num_accepted(4) for _ in range(20000)) / 20000
    assert mean == pytest.approx(AcceptanceModel.constant(0.7).expected_accepted(4), rel=0.03)


@pytest.mark.parametrize("rate", [0.0, 0.6, 1.0])
def test_requests_keep_their_lengths_and_the_counters_add_up(rate: float) -> None:
    """Every request ends with exactly its output length (EOS lands where it would
    without drafts, even inside an accepted run), and the scheduler's counters match
    the acceptance model."""
    cost = roofline_cost_model(get_model_spec("llama-2-7b"), get_hardware("h100"))
    wl = make_workload(60, rate=5.0, prompt_len="uniform:16:200",
                       output_len="uniform:1:120", seed=4)
    sc, cc = configs(seqs=16)
    sim = Simulator(sc, cc, cost, speculative_config=spec(4),
                    acceptance=AcceptanceModel.constant(rate, seed=1))
    res = sim.run(wl)
    assert res.num_rejected == 0
    assert sorted(res.output_len.tolist()) == sorted(s.output_len for s in wl.requests)
    assert not sim.engine.scheduler.requests
    st = sim.engine.scheduler.spec.stats
    assert st.num_drafts > 0
    assert st.num_accepted_tokens <= st.num_draft_tokens
    if rate == 0.0:
        assert st.num_accepted_tokens == 0
    if rate == 1.0:
        # All accepted except where a request's end cut a draft short.
        assert st.acceptance_rate > 0.8
    elif rate:
        # Accepted / drafted: 1.31 of 4 for a conditional rate of 0.6 (requests near
        # their end draft fewer, which moves it a little).
        want = AcceptanceModel.constant(rate).expected_accepted(4) / 4
        assert st.acceptance_rate == pytest.approx(want, abs=0.06)


def test_verify_rows_are_priced_and_lose_the_one_token_path() -> None:
    """A step that verifies k drafts costs k more tokens of compute and never takes the
    runner's one-token path."""
    cost = roofline_cost_model(get_model_spec("llama-2-7b"), get_hardware("h100"))
    cost = dataclasses.replace(cost, lone_t0=1e-4, lone_context_token=0.0)
    wl = make_workload(1, arrival="all-at-once", prompt_len=32, output_len=200)
    sc, cc = configs(seqs=4)
    plain = compute_metrics(Simulator(sc, cc, cost).run(wl))
    sim = Simulator(sc, cc, cost, speculative_config=spec(4),
                    acceptance=AcceptanceModel.constant(0.0))
    on = compute_metrics(sim.run(wl))
    # Nothing is ever accepted: every step pays the batched path for no gain.
    assert on["tpot_ms"]["median"] > 5 * plain["tpot_ms"]["median"]


def test_speculation_helps_at_low_load_and_stops_at_high_load() -> None:
    """Fixed K, the default model's roofline on a small CPU (20 GB/s, 200 GFLOP/s):
    memory-bound small batches gain about the mean acceptance length; past the
    break-even batch the verify tokens' compute costs more than the tokens bring."""
    hw = HardwareSpec("small-cpu", 200e9, 20e9, 16e9, 20e9, step_overhead_s=1e-4)
    cost = roofline_cost_model(get_model_spec(str(packaged_model_dir())), hw)
    sc, cc = configs(seqs=256, blocks=20000)
    acc = AcceptanceModel.constant(0.7, seed=2)

    def at(batch: float):
        return make_workload(int(batch), arrival="all-at-once", prompt_len=64, output_len=128,
                             seed=1)

    loads = [1, 4, 16, 64]
    pts = sweep_loads(at, loads, sc, cc, cost, spec(4), acc)
    by = {p.load: p for p in pts}
    assert by[1].speedup > 1.6  # ~ 1 + .7 + .49 + .34 + .24 = 2.77 tokens per step
    # (One request's ~50 verify steps, the last ones cut short by its end.)
    assert by[1].mean_acceptance_length == pytest.approx(acc.mean_acceptance_length(4),
                                                         rel=0.2)
    assert by[64].speedup < 0.9
    assert [p.speedup for p in pts] == sorted((p.speedup for p in pts), reverse=True)
    be = break_even(pts)
    assert be is not None and 4 < be < 16
    assert "break-even batch" in format_points(pts, "batch")

    # The adaptive rule switches speculation off where it would lose: never much worse.
    adaptive = {p.load: p for p in sweep_loads(at, loads, sc, cc, cost, spec(4, adaptive=True),
                                               acc)}
    assert adaptive[1].speedup > 1.6
    assert adaptive[64].speedup > 0.97


def test_break_even_interpolates() -> None:
    pts = [LoadPoint(1, 10, 5), LoadPoint(3, 10, 8), LoadPoint(5, 10, 12.5)]
    # speedups 2, 1.25, 0.8: the crossing lies between 3 and 5, at 3 + 2 * .25 / .45.
    assert break_even(pts) == pytest.approx(3 + 2 * 0.25 / 0.45)
    assert break_even(pts[:2]) is None
    assert break_even([LoadPoint(2, 10, 11)]) == 2
    assert math.isnan(LoadPoint(1, 1, 0).speedup)


def test_a_speculative_simulation_needs_an_acceptance_model() -> None:
    cost = roofline_cost_model(get_model_spec("llama-2-7b"), get_hardware("h100"))
    sc, cc = configs()
    with pytest.raises(ValueError, match="acceptance model"):
        Simulator(sc, cc, cost, speculative_config=spec())


def test_simulate_cli_break_even_and_plain_run(tmp_path, capsys) -> None:
    from iterserve.entrypoints.cli import main

    common = ["simulate", "--model", "llama-2-7b", "--hardware", "h100", "--num-requests", "40",
              "--prompt-len", "fixed:64", "--output-len", "fixed:32", "--no-progress", "--plain",
              "--speculative-config",
              '{"method": "ngram", "num_speculative_tokens": 3, "adaptive": false}',
              "--spec-acceptance", '{"rate": 0.6}']
    assert main([*common, "--spec-break-even", "2,8", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "break-even req/s" in out
    data = json.loads((tmp_path / "spec_break_even.json").read_text())
    assert [p["rate"] for p in data["points"]] == [2.0, 8.0]
    assert all(p["speedup"] > 1 for p in data["points"])  # a 7B on an H100: memory-bound
    assert main([*common, "--request-rate", "4"]) == 0
    with pytest.raises(SystemExit, match="spec-acceptance"):
        main(common[:-2])
    with pytest.raises(SystemExit, match="speculative-config"):
        main(["simulate", "--num-requests", "10", "--spec-acceptance", '{"rate": 0.5}'])


def test_a_draft_models_own_time_is_priced() -> None:
    """The same acceptance with a proposer that takes time: a draft model as slow per
    step as the target gains nothing at batch 1."""
    cost = roofline_cost_model(get_model_spec("llama-2-7b"), get_hardware("h100"))
    sc, cc = configs(seqs=4)

    def at(batch: float):
        return make_workload(int(batch), arrival="all-at-once", prompt_len=64, output_len=128)

    free = AcceptanceModel.constant(0.7, seed=2)
    slow = AcceptanceModel.parse({"rate": 0.7, "seed": 2, "draft_step_s": cost.t0}, 4)
    assert slow.draft_time(4, 4) == pytest.approx(4 * cost.t0)
    (p_free,) = sweep_loads(at, [1], sc, cc, cost, spec(4), free)
    (p_slow,) = sweep_loads(at, [1], sc, cc, cost, spec(4), slow)
    assert p_free.speedup > 2.0
    assert p_slow.speedup < 0.8
    with pytest.raises(ValueError, match="draft costs"):
        AcceptanceModel.parse({"rate": 0.5, "draft_token_s": -1}, 4)
