"""``iterserve bench serve`` takes ``vllm bench serve``'s invocation: --backend,
prefix_repetition, --temperature left to the server, --save-detailed arrays,
--percentile-metrics deciding what is written, --ramp-up-strategy."""

from __future__ import annotations

import json

import numpy as np
import pytest

from iterserve.bench.datasets import SampleRequest
from iterserve.bench.serve import BenchConfig, benchmark, schedule_offsets
from iterserve.entrypoints.cli import main
from iterserve.measure.arrivals import arrival_times, ramp_up_arrival_times, ramp_up_rates

COMMON = ["--num-prompts", "4", "--random-input-len", "8", "--random-output-len", "3",
          "--tokenizer", "byte", "--disable-tqdm", "--save-result"]


def _run(stub, tmp_path, *flags: str) -> dict:
    out = tmp_path / "r.json"
    argv = ["bench", "serve", "--base-url", stub.base_url, *COMMON,
            "--result-filename", str(out), *flags]
    assert main(argv) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("backend,chat", [("openai", False), ("vllm", False),
                                          ("openai-chat", True)])
def test_backend_picks_the_api(stub, tmp_path, backend, chat):
    result = _run(stub, tmp_path, "--backend", backend)
    assert result["completed"] == 4 and result["backend"] == result["endpoint_type"] == backend
    body = stub.bodies[0]
    assert ("messages" in body) == chat and ("prompt" in body) != chat
    assert result["endpoint"] == ("/v1/chat/completions" if chat else "/v1/completions")


def test_backend_and_endpoint_must_agree(capsys):
    assert main(["bench", "serve", "--backend", "openai-chat", "--endpoint", "/v1/completions",
                 "--num-prompts", "1"]) == 2
    assert "openai-chat" in capsys.readouterr().err


def test_temperature_left_to_the_server_unless_given(stub, tmp_path):
    _run(stub, tmp_path)
    assert all("temperature" not in b for b in stub.bodies)
    stub.bodies.clear()
    _run(stub, tmp_path, "--temperature", "0.5")
    assert all(b["temperature"] == 0.5 for b in stub.bodies)


@pytest.mark.parametrize("spelling", ["prefix_repetition", "prefix-repetition"])
def test_prefix_repetition_both_spellings(stub, tmp_path, spelling):
    result = _run(stub, tmp_path, "--dataset-name", spelling,
                  "--prefix-repetition-prefix-len", "6", "--prefix-repetition-suffix-len", "2",
                  "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", "3")
    assert result["completed"] == 4 and result["dataset_name"] == "prefix_repetition"
    prompts = [b["prompt"] for b in stub.bodies]
    assert len({p[:6] for p in prompts}) <= 2  # byte tokenizer: one char per token


def test_save_detailed_writes_vllms_arrays(stub, tmp_path):
    plain = _run(stub, tmp_path)
    for key in ("itls", "start_times", "generated_texts"):
        assert key not in plain
    result = _run(stub, tmp_path, "--save-detailed")
    n = result["completed"]
    assert n == 4
    assert [len(x) for x in result["itls"]] == [o - 1 for o in result["output_lens"]]
    assert all(isinstance(g, float) and g >= 0 for x in result["itls"] for g in x)
    assert len(result["start_times"]) == n and min(result["start_times"]) >= 0
    assert all(t for t in result["generated_texts"])  # the stub streams text
    assert result["generated_texts"] == [r["generated_text"] for r in result["records"]]
    assert len(result["queue_times"]) == n and min(result["queue_times"]) >= 0


def test_percentile_metrics_decide_what_is_written(stub, tmp_path):
    result = _run(stub, tmp_path, "--percentile-metrics", "ttft,e2el",
                  "--metric-percentiles", "50,99")
    for name in ("ttft", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p99"):
            assert f"{stat}_{name}_ms" in result
    assert not [k for k in result if k.endswith(("_tpot_ms", "_itl_ms"))]


def test_ramp_up_rates_follow_vllms_formulas():
    assert ramp_up_rates(5, "linear", 2, 10).tolist() == [2, 4, 6, 8, 10]
    assert ramp_up_rates(3, "exponential", 1, 16).tolist() == pytest.approx([1, 4, 16])
    for bad in (("linear", 5, 2), ("exponential", 0, 4), ("linear", -1, 2), ("cubic", 1, 2)):
        with pytest.raises(ValueError):
            ramp_up_rates(4, *bad)


def test_ramp_up_arrivals():
    # A flat ramp is the constant-rate process of the same seed.
    flat = ramp_up_arrival_times(50, "linear", 4, 4, burstiness=0.5, seed=3)
    assert flat == pytest.approx(arrival_times(50, "gamma", 4, 0.5, seed=3))
    # A ramp from 0 works (the first gap is dropped) and the gaps shrink as it climbs.
    t = ramp_up_arrival_times(4000, "linear", 0, 100, seed=1)
    gaps = np.diff(t)
    assert t[0] == 0 and np.all(gaps >= 0)
    assert gaps[:500].mean() > 5 * gaps[-500:].mean()
    regular = ramp_up_arrival_times(4, "exponential", 1, 8, burstiness=float("inf"))
    assert np.diff(regular) == pytest.approx([1 / 2, 1 / 4, 1 / 8])


def test_ramp_up_config():
    reqs = [SampleRequest("p", 1, 1) for _ in range(3)]
    cfg = BenchConfig(ramp_up_strategy="exponential", ramp_up_start_rps=1, ramp_up_end_rps=4,
                      burstiness=float("inf"))
    cfg.validate()
    assert schedule_offsets(reqs, cfg).tolist() == pytest.approx([0, 0.5, 0.75])
    for bad in (dict(ramp_up_strategy="linear", ramp_up_start_rps=1),
                dict(ramp_up_start_rps=1, ramp_up_end_rps=2),
                dict(ramp_up_strategy="linear", ramp_up_start_rps=1, ramp_up_end_rps=2,
                     request_rate=5.0)):
        with pytest.raises(ValueError):
            BenchConfig(**bad).validate()


def test_ramp_up_run(stub, tmp_path):
    result = _run(stub, tmp_path, "--ramp-up-strategy", "linear", "--ramp-up-start-rps", "50",
                  "--ramp-up-end-rps", "200")
    assert result["completed"] == 4
    assert (result["ramp_up_strategy"], result["ramp_up_start_rps"],
            result["ramp_up_end_rps"]) == ("linear", 50, 200)


def test_benchmark_api_sends_sampling_as_given(stub):
    cfg = BenchConfig(base_url=stub.base_url, model="stub-model", disable_tqdm=True)
    benchmark([SampleRequest("ttft=0.01 itl=0.01 x", 1, 2)], cfg, verbose=False)
    assert "temperature" not in stub.bodies[0]
