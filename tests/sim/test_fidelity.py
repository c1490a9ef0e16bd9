"""Simulator fidelity: profiles round-trip, the fit reports per-regime and held-out
errors and refuses a poor fit, held-out validation reports every metric, and the
engine's per-request records summarise as the simulator's metrics do."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest
import torch

from iterserve.config import CacheConfig, SchedulerConfig
from iterserve.core.outputs import ModelRunnerOutput
from iterserve.measure.latency import RequestMetrics
from iterserve.measure.request_log import RequestLog, read_request_log, summarize_records
from iterserve.model.step_layout import RunnerLayout
from iterserve.sim.calibrate import GridPoint, calibrate, heldout_grid
from iterserve.sim.cost_model import CostModel, masked_prefill_pairs
from iterserve.sim.fit import (
    REGIMES,
    StepSample,
    fit_cost_model,
    format_regime_errors,
    heldout_problems,
    predict,
    regime_errors,
)
from iterserve.sim.simulator import Simulator, compute_metrics
from iterserve.sim.validate import METRICS, at_rate, heldout_workload, validate

FULL = CostModel(t0=4e-3, prefill_token=2e-5, decode_seq=3e-4, context_token=2e-7,
                 swap_block=1e-4, decode_pad_token=2e-7, prefill_attn=3e-9,
                 prefill_attn_masked=1e-9, name="full", block_size=16, decode_group_size=8,
                 lone_t0=1e-3, lone_context_token=1e-8)


def test_profile_round_trips_with_identical_predictions(tmp_path):
    cm = CostModel(**{**FULL.to_dict(), "fit": {"r2": 0.9, "regimes": {"decode": {
        "num_samples": 3.0, "mean_abs_rel_error": 0.1, "max_abs_rel_error": 0.2}}}})
    cm.save(tmp_path / "p.json")
    back = CostModel.load(tmp_path / "p.json")
    assert back.to_dict() == cm.to_dict()
    # The same predictions, step for step: one workload simulated with each.
    from iterserve.sim.workload import make_workload

    wl = make_workload(60, rate=50.0, prompt_len="uniform:8:600", output_len="uniform:1:40",
                       seed=3)
    sc = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=2048)
    cc = CacheConfig(block_size=16, num_gpu_blocks=2048, enable_prefix_caching=False)
    a, b = Simulator(sc, cc, cm).run(wl), Simulator(sc, cc, back).run(wl)
    assert np.array_equal(a.step_dt, b.step_dt) and a.num_steps == b.num_steps
    assert np.array_equal(a.finished, b.finished, equal_nan=True)


def test_masked_pairs_priced_apart_and_old_files_price_them_as_causal(tmp_path):
    from tests.sim.test_calibrate_attention import _step

    so = _step([100, 200], [(64, 0), (64, 320)])  # a fresh chunk and one on 320 cached
    assert masked_prefill_pairs(so) == 64 * 320 + 64 * 65 // 2
    cheap = CostModel(**{**FULL.to_dict(), "prefill_attn_masked": 0.0})
    dear = CostModel(**{**FULL.to_dict(), "prefill_attn_masked": 1e-6})
    assert dear.step_time(so) - cheap.step_time(so) == pytest.approx(1e-6 * masked_prefill_pairs(so))
    old = {k: v for k, v in FULL.to_dict().items() if k != "prefill_attn_masked"}
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert CostModel.load(tmp_path / "old.json").prefill_attn_masked == FULL.prefill_attn


def _samples(truth: CostModel, rng: np.random.Generator, n: int) -> list[StepSample]:
    """Steps of every regime, times from ``truth`` with 2% noise."""
    out = []
    for _ in range(n):
        kind = rng.integers(0, 4)
        d = 1 if kind == 3 else int(rng.integers(1, 64)) if kind != 1 else 0
        p = 0 if kind in (0, 3) else int(rng.integers(2, 2048))
        ctx = d * int(rng.integers(16, 1024)) + p
        pairs = p * (p + 1) // 2
        s = StepSample(p, d, ctx, 0, 0.0, 0, pairs)
        s.seconds = predict(truth, s) * (1 + 0.02 * rng.standard_normal())
        out.append(s)
    return out


def test_fit_reports_errors_per_regime_and_refuses_poor_heldout_fits():
    rng = np.random.default_rng(4)
    layout = RunnerLayout(block_size=16, decode_group_size=8, lone_token_path=True)
    truth = FULL
    cm = fit_cost_model(_samples(truth, rng, 300), layout=layout)
    held = _samples(truth, rng, 80)
    cm.fit["regimes"] = regime_errors(cm, _samples(truth, rng, 80))
    cm.fit["heldout"] = regime_errors(cm, held)
    assert set(cm.fit["heldout"]) == {*REGIMES, "all"}
    for d in cm.fit["heldout"].values():
        assert 0 <= d["mean_abs_rel_error"] <= d["max_abs_rel_error"] < 0.2
    assert heldout_problems(cm.fit, 0.15) == []
    table = format_regime_errors(cm.fit)
    assert all(k in table for k in REGIMES)
    # A model that misprices decodes is refused, naming the regime.
    bad = CostModel(**{**cm.to_dict(), "decode_seq": cm.decode_seq * 3})
    bad.fit = {"heldout": regime_errors(bad, held)}
    problems = heldout_problems(bad.fit, 0.15)
    assert any(p.startswith("decode") for p in problems)
    assert not any(p.startswith("prefill") for p in problems)


class _SleepingRunner:
    """Takes ``truth``'s time for each step (a stand-in whose cost is known)."""

    step_layout = RunnerLayout(block_size=16, decode_group_size=8)

    def __init__(self, truth: CostModel) -> None:
        self.truth = truth

    def execute(self, so):
        end = time.perf_counter() + self.truth.step_time(so)
        while time.perf_counter() < end:
            pass
        return ModelRunnerOutput({
            r.request_id: 5
            for r, n, c in zip(so.scheduled_requests, so.num_scheduled_tokens,
                               so.num_computed_tokens) if c + n == r.num_tokens
        })


def test_calibrate_times_heldout_shapes_apart():
    truth = CostModel(t0=1e-3, prefill_token=2e-7, decode_seq=2e-5, context_token=2e-9,
                      decode_group_size=8)
    grid = [GridPoint(4, 64, 64, 2), GridPoint(8, 128, 256, 2, 0.5), GridPoint(1, 100, 64, 3),
            GridPoint(16, 32, 128, 2)]
    held = [GridPoint(6, 96, 128, 2, 0.5, late_prompt=300)]
    heldout_out: list[StepSample] = []
    cm = calibrate(_SleepingRunner(truth), num_gpu_blocks=512, grid=grid, heldout=held,
                   heldout_out=heldout_out)
    assert heldout_out and all(s.heldout for s in heldout_out)
    # The late prompt's chunks ran beside the six decodes.
    assert any(s.regime == "mixed" and s.num_decode_seqs == 6 for s in heldout_out)
    assert "all" in cm.fit["regimes"] and "mixed" in cm.fit["heldout"]
    assert cm.meta["heldout_grid"][0]["late_prompt"] == 300
    assert all(p.chunk >= 64 for p in heldout_grid(quick=True))


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    from iterserve.engine.builder import build_engine, engine_config_from_args

    torch.set_num_threads(1)
    mp = pytest.MonkeyPatch()
    mp.setenv("ITERSERVE_CACHE", str(tmp_path_factory.mktemp("cache")))
    try:
        yield build_engine(engine_config_from_args(
            None, num_gpu_blocks=256, max_num_seqs=8, enable_prefix_caching=False))
    finally:
        mp.undo()


def test_heldout_validation_report_has_every_metric(tiny_engine):
    core, tokenizer, mc = tiny_engine
    cm = CostModel(t0=2e-3, prefill_token=2e-6, decode_seq=2e-5, context_token=1e-8,
                   name="guess")
    steps: list[StepSample] = []
    rep = validate(core, tokenizer, cm, "splitwise_conv", num_requests=5, load=0.5,
                   max_output_len=6, vocab_size=mc.vocab_size, steps_out=steps)
    assert rep.num_requests == 5 and rep.load == pytest.approx(0.5)
    # The replayed steps come back with their rows (the long-context terms price them).
    assert len(steps) == rep.meta["num_steps_measured"]
    assert all(s.decode_contexts or s.prefill_chunks for s in steps)
    for k, _ in METRICS:
        a, b = rep.measured[k], rep.simulated[k]
        assert a > 0 and b > 0 and math.isfinite(rep.errors[k]), k
        assert rep.errors[k] == pytest.approx((b - a) / a)
    d = json.loads(json.dumps(rep.to_dict()))
    assert set(d["metrics"]) == {k for k, _ in METRICS}
    assert d["meta"]["measured_on"].startswith("engine clock")
    # Every replayed step priced against the cost model, by kind.
    assert d["meta"]["step_errors"]["all"]["num_samples"] == d["meta"]["num_steps_measured"] > 0
    assert rep.simulated["num_steps"] > 0
    assert "TTFT p90 (ms)" in rep.format()


def test_heldout_workload_fits_the_context_and_keeps_the_trace_schedule():
    wl = heldout_workload("splitwise_code", 20, max_model_len=512, max_output_len=16)
    assert all(s.prompt_len + s.output_len <= 512 and s.output_len <= 16 for s in wl.requests)
    assert all(s.max_tokens == s.output_len for s in wl.requests)
    assert wl.requests[0].arrival_time == 0.0
    fast = at_rate(wl, 4.0)
    assert fast.arrival_rate == pytest.approx(4.0, rel=0.01)


def test_request_log_records_summarise_like_the_simulator(tmp_path):
    log = RequestLog(tmp_path / "r.jsonl")
    # Two requests: arrivals 0 and 1, first tokens 0.5 and 1.2, four outputs each.
    for rid, arr, first in (("a", 0.0, 0.5), ("b", 1.0, 1.2)):
        m = RequestMetrics(arr, arr + 0.1, first, first + 0.3, num_prompt_tokens=10,
                           num_output_tokens=4, last_token_time=first + 0.3,
                           num_token_outputs=4)
        log.write(rid, "length", m)
    log.close()
    recs = read_request_log(tmp_path / "r.jsonl")
    assert [r["request_id"] for r in recs] == ["a", "b"]
    assert recs[0]["ttft"] == pytest.approx(0.5) and recs[0]["itl_mean"] == pytest.approx(0.1)
    assert recs[1]["queue_time"] == pytest.approx(0.1)
    s = summarize_records(recs)
    assert s["output_throughput"] == pytest.approx(8 / 1.5)
    assert s["ttft_mean_ms"] == pytest.approx(350.0)
    assert s["itl_mean_ms"] == pytest.approx(100.0)
    assert s["e2e_mean_ms"] == pytest.approx(650.0)
    with pytest.raises(ValueError, match="no finished"):
        summarize_records([])


def test_simulator_metrics_match_records_of_the_same_times():
    """The validation's two sides define each metric alike: a simulated run's own
    records, summarised as the engine's are, give the simulator's metrics."""
    from iterserve.sim.workload import make_workload

    wl = make_workload(40, rate=20.0, prompt_len="uniform:8:300", output_len="uniform:2:30",
                       seed=1, reveal_output_len=True)
    sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=2048)
    cc = CacheConfig(block_size=16, num_gpu_blocks=1024, enable_prefix_caching=False)
    res = Simulator(sc, cc, FULL).run(wl)
    m = compute_metrics(res)
    recs = [{"arrival_time": a, "finished_time": f, "ttft": t - a, "e2e": f - a, "tpot": None,
             "num_output_tokens": int(o), "finish_reason": "length"}
            for a, t, f, o in zip(res.arrival, res.first_token, res.finished, res.output_len)]
    s = summarize_records(recs, list(res.itl))
    assert s["output_throughput"] == pytest.approx(m["output_token_throughput"])
    assert s["ttft_mean_ms"] == pytest.approx(m["ttft_ms"]["mean"])
    assert s["ttft_p90_ms"] == pytest.approx(m["ttft_ms"]["p90"])
    assert s["itl_mean_ms"] == pytest.approx(m["itl_ms"]["mean"])
    assert s["e2e_mean_ms"] == pytest.approx(m["e2e_ms"]["mean"])


def test_cli_warns_on_a_poor_heldout_fit_refuses_when_strict_and_validates(tmp_path, monkeypatch,
                                                                          capsys):
    """``iterserve calibrate`` on the built-in tiny model, with a held-out threshold
    nothing meets: by default the profile is written with a warning naming the regimes;
    --strict refuses it (exit 1, no file, the reason said); --validate replays a few trace
    requests and writes the report, with the step errors by context."""
    from iterserve.entrypoints.cli import main

    monkeypatch.setenv("ITERSERVE_CACHE", str(tmp_path / "cache"))
    torch.set_num_threads(1)
    out, rep = tmp_path / "p.json", tmp_path / "v.json"
    base = ["calibrate", "--quick", "--repeats", "1", "--num-gpu-blocks", "512",
            "--max-heldout-error", "0.0001", "--out", str(out)]
    assert main([*base, "--strict"]) == 1
    assert not out.exists()
    err = capsys.readouterr().err
    assert "not writing" in err and "held-out" in err and "--force" in err
    assert main([*base, "--validate", "summarization_long", "--num-requests", "3",
                 "--max-output-len", "4", "--load", "0.5", "--json", str(rep)]) == 0
    captured = capsys.readouterr()
    assert "warning: held-out error" in captured.err
    cm = CostModel.load(out)
    assert set(cm.fit["heldout"]) >= {"decode", "mixed", "all"}
    report = json.loads(rep.read_text())["reports"][0]
    assert report["trace"] == "summarization_long" and report["num_requests"] == 3
    buckets = report["meta"]["step_errors_by_context"]
    assert buckets and all(b["num_samples"] > 0 for b in buckets)
    assert sum(b["num_samples"] for b in buckets) == report["meta"]["num_steps_measured"]
    assert all(math.isfinite(v["error"]) for v in report["metrics"].values())
    printed = captured.out
    assert "held out" in printed and "TTFT p90 (ms)" in printed
    assert "mean context per request" in printed


def test_simulate_compares_with_a_server_request_log(tmp_path, capsys):
    """``simulate --compare-with requests.jsonl``: the server's own timings beside the
    simulation, and a note that the log does not record the engine's settings."""
    from iterserve.entrypoints.cli import main

    log = RequestLog(tmp_path / "requests.jsonl")
    for i in range(20):
        a = 0.1 * i
        log.write(f"r{i}", "length", RequestMetrics(
            a, a + 0.01, a + 0.05, a + 0.25, num_prompt_tokens=100, num_output_tokens=11,
            last_token_time=a + 0.25, num_token_outputs=11))
    log.close()
    rc = main(["simulate", "--num-requests", "20", "--request-rate", "10", "--prompt-len",
               "fixed:100", "--output-len", "fixed:11", "--compare-with",
               str(tmp_path / "requests.jsonl"), "--plain", "--no-progress"])
    assert rc == 0
    cap = capsys.readouterr()
    text = cap.out + cap.err
    assert "measured" in text and "request log" in text
    ttft_row = next(line for line in cap.out.splitlines() if line.startswith("TTFT mean"))
    assert ttft_row.split()[-1] == "50.00"
    itl_row = next(line for line in cap.out.splitlines() if line.startswith("ITL mean"))
    assert itl_row.split()[-1] == "20.00"


@pytest.mark.parametrize("argv, match", [
    (["--validate", "no_such_trace"], "no_such_trace"),
    (["--validate", "splitwise_conv", "--load", "0"], "--load"),
    (["--validate", "splitwise_conv", "--load", "half"], "--load"),
    (["--profile", "p.json"], "--validate"),
    (["--max-heldout-error", "0"], "--max-heldout-error"),
])
def test_calibrate_refuses_bad_flags_before_timing_anything(argv, match, capsys):
    from iterserve.entrypoints.cli import main

    assert main(["calibrate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("iterserve: error:") and match in err


def test_a_speed_probe_prices_the_machine_then_and_rescales_the_simulation(tiny_engine):
    """With probe=True the replay is bracketed by timings of calibration shapes; their
    ratio to the profile's prices rescales a second simulation of the same workload."""
    from iterserve.sim.validate import speed_probe

    core, tokenizer, mc = tiny_engine
    cm = CostModel(t0=2e-3, prefill_token=2e-6, decode_seq=2e-5, context_token=1e-8,
                   name="guess")
    r = speed_probe(core, cm, tokenizer=tokenizer, vocab_size=mc.vocab_size)
    assert math.isfinite(r) and r > 0
    # A profile that prices everything 10x higher reads as a machine 10x faster.
    assert speed_probe(core, cm.scaled(10.0), tokenizer=tokenizer,
                       vocab_size=mc.vocab_size) < r
    rep = validate(core, tokenizer, cm, "splitwise_conv", num_requests=4, load=0.5,
                   max_output_len=4, vocab_size=mc.vocab_size, probe=True)
    probe = rep.meta["speed_probe"]
    assert probe["before"] > 0 and probe["after"] > 0
    at = rep.errors_at_probe_speed
    assert set(at) == set(rep.errors) and all(math.isfinite(v) for v in at.values())
    assert "speed probe:" in rep.format()
    assert not core.has_unfinished_requests()


def test_a_scaled_profile_prices_every_step_by_the_factor():
    from iterserve.sim.calibrate import GridPoint, collect_samples
    from iterserve.sim.fit import predict

    cm = CostModel(t0=2e-3, prefill_token=2e-6, decode_seq=2e-5, context_token=1e-8,
                   prefill_attn=1e-9, lone_t0=1e-3, lone_context_token=1e-8, expert_read=1e-4,
                   num_experts=8, experts_per_token=2, context_knots=(512,),
                   decode_excess=(1e-9,), prefill_excess=(1e-10,), lone_excess=(2e-9,))
    free = _SleepingRunner(CostModel(t0=0.0, prefill_token=0.0, decode_seq=0.0, context_token=0.0))
    samples = collect_samples(free, [GridPoint(3, 700, 512, 3), GridPoint(1, 600, 512, 2)],
                              num_gpu_blocks=512, block_size=16, max_model_len=2048)
    s2 = cm.scaled(2.5)
    for s in samples:
        assert predict(s2, s) == pytest.approx(2.5 * predict(cm, s))
    with pytest.raises(ValueError, match="factor"):
        cm.scaled(0.0)
