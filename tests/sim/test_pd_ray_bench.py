"""benchmarks/pd_ray.py's pure parts: its flags, the statistics both sides share, the link
fit, the KV counters and the simulator's prediction on a tiny profile (no Ray here)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

from iterserve.sim.cost_model import CostModel
from iterserve.sim.disagg import KVLink

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import pd_ray  # noqa: E402

COST = CostModel(t0=5e-3, prefill_token=2e-5, decode_seq=3e-5, context_token=2e-7)
SETUP = pd_ray.Setup(max_model_len=512, num_gpu_blocks=128, prompt_len=(32, 96),
                     output_len=(4, 12))


def test_flags() -> None:
    a = pd_ray.parse_args(["--quick", "--num-prompts", "50", "--loads", "0.2,0.5"])
    assert a.quick and a.num_prompts == 12 and a.loads == [0.2, 0.5] and a.rates is None
    assert a.cores == [0, 1]
    assert pd_ray.parse_args(["--rates", "1,2.5"]).rates == [1.0, 2.5]
    for bad in (["--cores", "0"], ["--cores", "1,1"], ["--loads", "0,0.5"]):
        with pytest.raises(SystemExit):
            pd_ray.parse_args(bad)


def test_measured_stats_from_a_bench_result() -> None:
    res = {"ttfts": [0.1, 0.2, 0.0], "latencies": [1.1, 0.2, 0.0], "output_lens": [11, 1, 0],
           "errors": ["", "", "boom"], "duration": 2.0}
    s = pd_ray.measured_stats(res, {"ttft": 150.0, "tpot": 1000.0})
    assert s["ttft_p50"] == pytest.approx(150.0)  # the failed request left out
    assert s["tpot_p50"] == pytest.approx(100.0)  # (1.1 - 0.1) / 10, the 1-token one has none
    assert s["goodput"] == pytest.approx(0.5)  # only the first is within both


def test_link_fit_recovers_latency_and_bandwidth() -> None:
    link = KVLink(16.0, 2e-3)
    samples = [(b, link.transfer_time(b)) for b in (1e5, 1e6, 4e6)]
    fit = pd_ray.fit_link(samples)
    assert fit.bandwidth_gbps == pytest.approx(16.0)
    assert fit.latency_s == pytest.approx(2e-3)
    with pytest.raises(ValueError, match="two transfer sizes"):
        pd_ray.fit_link([(1e5, 1e-3), (1e5, 2e-3)])


def test_kv_counters_between_snapshots() -> None:
    before = pd_ray.kv_totals([{"role": "prefill", "export_s": 1.0, "num_tokens_saved": 100,
                                "num_sent": 1, "bytes_saved": 1000}])
    after = pd_ray.kv_totals([
        {"role": "prefill", "export_s": 1.5, "send_s": 0.5, "num_tokens_saved": 600,
         "num_sent": 3, "bytes_saved": 6000},
        {"role": "decode", "recv_s": 0.25, "import_s": 0.25},
    ])
    kv = pd_ray.kv_per_token(after, before)
    assert kv["transfers"] == 2 and kv["tokens"] == 500
    assert kv["us_per_token"] == pytest.approx(1.5 / 500 * 1e6)
    assert kv["ms_per_transfer"] == pytest.approx(750.0)
    assert kv["bytes_per_transfer"] == pytest.approx(2500.0)
    assert kv["export_us_per_token"] == pytest.approx(1000.0)


def test_prediction_on_a_tiny_profile() -> None:
    rs = pd_ray.rows(30, SETUP, seed=0)
    assert rs == pd_ray.rows(30, SETUP, seed=0)
    assert all(32 <= p <= 96 and 4 <= o <= 12 for p, o in rs)
    wl = pd_ray.workload(rs, 5.0, seed=0)
    slo = {"ttft": 1e4, "tpot": 1e4}
    kv_bytes = 8 * 2 * 4 * 64 * 4.0
    co = pd_ray.predict("colocated", COST, SETUP, wl, slo, KVLink(10.0), kv_bytes)
    fast = pd_ray.predict("disaggregated", COST, SETUP, wl, slo, KVLink(1000.0), kv_bytes)
    slow = pd_ray.predict("disaggregated", COST, SETUP, wl, slo, KVLink(0.01, 0.05), kv_bytes)
    for s in (co, fast, slow):
        assert all(math.isfinite(v) for v in s.values())
        assert s["ttft_p50"] <= s["ttft_p90"] <= s["ttft_p99"]
        # Every request within SLOs this loose: goodput is the completion rate.
        assert 0 < s["goodput"] <= 30 / (wl.requests[-1].arrival_time - wl.requests[0].arrival_time)
    # A slow link delays every decode: TPOT counts it (TTFT is the prefill's token).
    assert slow["tpot_p50"] > fast["tpot_p50"]
    assert slow["ttft_p50"] == pytest.approx(fast["ttft_p50"])


def test_kv_shape_from_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        '{"num_attention_heads": 8, "hidden_size": 512, "num_hidden_layers": 8, '
        '"num_key_value_heads": 4}')
    shape = pd_ray.kv_shape(tmp_path, 16)
    assert shape == (8, 2, 1, 16, 4, 64)
    assert float(np.prod(shape)) * 4 / 16 == 16384.0  # llama-56m: 16 kB of KV per token
