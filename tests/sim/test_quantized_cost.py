"""Quantized and MoE pricing: the roofline reads each weight at its format's bytes and
decodes it, FLOPs and KV stay; the fit recovers a quantized MoE model's expert read;
profiles keep what their weights were; `simulate --quantization`."""

from __future__ import annotations

import json

import pytest

from iterserve.entrypoints.cli import main
from iterserve.sim.calibrate import _with_weights
from iterserve.sim.cost_model import (
    HARDWARE_PRESETS,
    MODEL_PRESETS,
    CostModel,
    ModelSpec,
    get_model_spec,
    load_cost_model,
    roofline_cost_model,
)
from iterserve.sim.fit import ExpertShape, fit_cost_model, synthetic_samples
from iterserve.sim.weight_formats import (
    WEIGHT_FORMATS,
    compressed_tensors_format,
    get_weight_format,
)

H100 = HARDWARE_PRESETS["h100"]


def test_bytes_per_weight_are_the_formats_block_sizes():
    assert get_weight_format("Q8_0").bytes_per_weight == 34 / 32
    assert get_weight_format("q4_0").bytes_per_weight == 18 / 32
    assert get_weight_format("Q4_K").bytes_per_weight == 144 / 256
    assert get_weight_format("q6_k").bytes_per_weight == 210 / 256
    assert get_weight_format("bf16").bytes_per_weight == 2 and not get_weight_format("bf16").is_quantized
    # int4 at load: a float32 scale and min per group.
    assert get_weight_format("int4", group_size=128).bytes_per_weight == 0.5 + 8 / 128
    with pytest.raises(ValueError, match="unknown quantization 'q3_k'"):
        get_weight_format("q3_k")


def test_quantized_spec_shrinks_weights_not_flops_or_kv():
    bf16 = MODEL_PRESETS["qwen3-8b"]
    q4 = bf16.quantized("q4_k_m")
    assert q4.quantization == "q4_k_m" and bf16.quantization == ""
    assert q4.num_params == bf16.num_params and q4.active_params == bf16.active_params
    assert q4.kv_bytes_per_token == bf16.kv_bytes_per_token
    assert q4.weight_bytes == pytest.approx(bf16.weight_bytes * (4.89 / 8) / 2, rel=1e-6)
    a, b = roofline_cost_model(bf16, H100), roofline_cost_model(q4, H100)
    assert b.prefill_token == a.prefill_token and b.decode_seq == a.decode_seq
    assert b.context_token == a.context_token
    # t0 = read at the format's bytes + decode (ops per weight at the vector rate) + overhead.
    bw = H100.mem_bandwidth * H100.bandwidth_efficiency
    read = q4.dense_params * q4.bytes_per_weight / bw
    dequant = q4.dense_params * WEIGHT_FORMATS["q4_k_m"].dequant_ops / H100.dequant_flops
    assert b.t0 == pytest.approx(read + dequant + H100.step_overhead_s, rel=1e-6)
    assert b.meta["t0_dequant_s"] == pytest.approx(dequant) and a.meta["t0_dequant_s"] == 0
    assert b.quantization == "q4_k_m" and b.weight_bytes == q4.dense_bytes


@pytest.mark.parametrize("hw", sorted(HARDWARE_PRESETS))
@pytest.mark.parametrize("model", ["llama-2-7b", "qwen3-8b", "qwen3-30b-a3b"])
def test_batch_one_decode_q4_below_q8_below_bf16(model, hw):
    spec = get_model_spec(model)
    spec = ModelSpec(**{**{f: getattr(spec, f) for f in spec.__slots__}, "dtype": "bfloat16"})
    step = {q: roofline_cost_model(spec.quantized(q), HARDWARE_PRESETS[hw]).time_for(
        num_decode_seqs=1, num_context_tokens=512) for q in ("q4_k_m", "q4_0", "q8_0", None)}
    assert step["q4_k_m"] < step["q8_0"] < step[None]
    assert step["q4_0"] < step["q8_0"]


def test_moe_expert_reads_shrink_with_the_format():
    bf16 = MODEL_PRESETS["qwen3-30b-a3b"]
    a, b = roofline_cost_model(bf16, H100), roofline_cost_model(bf16.quantized("q8_0"), H100)
    bw = H100.mem_bandwidth * H100.bandwidth_efficiency
    decode = 2 / H100.dequant_flops  # Q8_0's two operations per weight
    per_weight = (34 / 32) / bw + decode
    assert b.expert_read == pytest.approx(a.expert_read * per_weight / (2 / bw), rel=1e-6)
    assert b.expert_bytes == pytest.approx(a.expert_bytes * 34 / 64, rel=1e-6)
    assert b.num_experts == 128 and b.experts_per_token == 8


def test_compressed_tensors_config_is_priced_in_its_format():
    cfg = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
           "intermediate_size": 128, "vocab_size": 1000, "torch_dtype": "float32",
           "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                   "config_groups": {"group_0": {"weights": {
                                       "num_bits": 4, "strategy": "group", "group_size": 128}}}}}
    fmt = compressed_tensors_format(cfg)
    assert fmt is not None and fmt.name == "w4a16" and fmt.bytes_per_weight == 0.5 + 2 / 128
    spec = ModelSpec.from_hf_config(cfg)
    assert spec.bytes_per_weight == fmt.bytes_per_weight and spec.dtype_bytes == 4
    cfg.pop("quantization_config")
    assert compressed_tensors_format(cfg) is None
    assert ModelSpec.from_hf_config(cfg).bytes_per_weight == 4


def test_fit_recovers_a_quantized_moe_models_expert_read():
    truth = roofline_cost_model(MODEL_PRESETS["qwen3-30b-a3b"].quantized("q4_k_m"), H100)
    samples = synthetic_samples(truth, n=300, noise=0.01, seed=3)
    shape = ExpertShape(truth.num_experts, truth.experts_per_token, truth.expert_bytes)
    fitted = fit_cost_model(samples, experts=shape)
    for name in ("t0", "expert_read", "prefill_token", "context_token"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=0.05), name
    assert (fitted.num_experts, fitted.experts_per_token) == (128, 8)
    assert fitted.expert_bytes == truth.expert_bytes
    assert fitted.fit["rms_rel_error"] < 0.02
    # Without the column the linear terms absorb the expert reads, and misprice.
    dense = fit_cost_model(samples)
    assert dense.expert_read == 0 and dense.fit["rms_rel_error"] > 3 * fitted.fit["rms_rel_error"]


def test_fit_without_expert_bytes_gives_seconds_per_expert():
    truth = CostModel(t0=2e-3, prefill_token=2e-5, decode_seq=3e-5, context_token=1e-7,
                      expert_read=4e-5, num_experts=16, experts_per_token=2)
    fitted = fit_cost_model(synthetic_samples(truth, n=300, noise=0.005, seed=5),
                            experts=ExpertShape(16, 2))
    assert fitted.expert_read == pytest.approx(4e-5, rel=0.05)
    with pytest.raises(ValueError, match="experts_per_token"):
        ExpertShape(4, 5)


def test_a_quantized_profile_saves_and_loads(tmp_path):
    truth = roofline_cost_model(MODEL_PRESETS["qwen3-30b-a3b"].quantized("q4_k_m"), H100)
    samples = synthetic_samples(truth, n=200, noise=0.01, seed=2)
    cm = fit_cost_model(samples, experts=ExpertShape(128, 8, truth.expert_bytes))
    cm = _with_weights(cm, {"quantization": "q4_k_m", "bytes_per_weight": truth.bytes_per_weight,
                            "weight_bytes": truth.weight_bytes})
    # The fitted seconds per expert byte price the dense read as well.
    per_byte = cm.expert_read / cm.expert_bytes
    assert cm.meta["t0_weight_read_s"] == pytest.approx(per_byte * truth.weight_bytes)
    assert cm.meta["t0_weight_read_s"] == pytest.approx(truth.meta["t0_weight_read_s"]
                                                        + truth.meta["t0_dequant_s"], rel=0.1)
    path = tmp_path / "q4.json"
    cm.save(path)
    back = CostModel.load(path)
    assert back.to_dict() == cm.to_dict()
    assert (back.quantization, back.num_experts) == ("q4_k_m", 128)
    d = json.loads(path.read_text())
    d["bytes_per_weight"] = -1
    with pytest.raises(ValueError, match="bytes_per_weight"):
        CostModel.from_dict(d)
    # Files without the fields load as float weights of unknown size.
    for k in ("quantization", "bytes_per_weight", "weight_bytes", "expert_bytes"):
        d.pop(k)
    assert CostModel.from_dict(d).quantization == ""


def test_load_cost_model_quantization():
    a = load_cost_model(model="llama-3-8b", hardware="h100")
    b = load_cost_model(model="llama-3-8b", hardware="h100", quantization="int8")
    assert b.t0 < a.t0 and b.bytes_per_weight == 1.0


def _tpot(out: str) -> float:
    line = next(ln for ln in out.splitlines() if ln.startswith("TPOT mean"))
    return float(line.split()[-1].replace(",", ""))


def test_simulate_cli_quantization(tmp_path, capsys):
    args = ["simulate", "--model", "llama-3-8b", "--hardware", "h100", "--num-requests", "40",
            "--request-rate", "4", "--prompt-len", "fixed:256", "--output-len", "fixed:64",
            "--no-progress", "--plain", "--no-plots"]
    assert main(args) == 0
    bf16 = capsys.readouterr().out
    assert main([*args, "--quantization", "q4_k_m"]) == 0
    q4 = capsys.readouterr().out
    assert "weights: q4_k_m, 0.611 bytes/weight" in q4 and "weights: float, 2.000" in bf16
    assert _tpot(q4) < _tpot(bf16)
    with pytest.raises(SystemExit, match="unknown quantization"):
        main([*args, "--quantization", "q2_k"])
    # A profile prices what it was calibrated on: another format is refused.
    prof = tmp_path / "p.json"
    load_cost_model(model="llama-3-8b").save(prof)
    with pytest.raises(SystemExit, match="calibrate the quantized model"):
        main([*args, "--profile", str(prof), "--quantization", "q4_k_m"])


def test_calibrate_fits_the_expert_read_of_a_moe_runner(monkeypatch):
    """Through the real scheduler: a runner whose steps take a known MoE cost (on a
    virtual clock) calibrates to that cost, and the profile records its weights."""
    from iterserve.sim import calibrate as cal
    from tests.sim.test_calibrate import _FakeRunner

    truth = CostModel(t0=1e-3, prefill_token=2e-5, decode_seq=1e-5, context_token=1e-8,
                      expert_read=5e-5, num_experts=16, experts_per_token=2)
    clock = [0.0]

    class MoERunner(_FakeRunner):
        def execute(self, so):
            clock[0] += truth.step_time(so)
            return super().execute(so)

    monkeypatch.setattr(cal.time, "perf_counter", lambda: clock[0])
    grid = [cal.GridPoint(b, 64, 256, 4) for b in (1, 2, 3, 4, 6, 8, 12, 16, 32)]
    grid.append(cal.GridPoint(2, 512, 256, 2))
    cm = cal.calibrate(MoERunner(), num_gpu_blocks=512, block_size=16, grid=grid,
                       max_model_len=1024, vocab_size=1000,
                       heldout=[cal.GridPoint(5, 100, 256, 3)],
                       experts=ExpertShape(16, 2, 2e6),
                       weights={"quantization": "int4", "bytes_per_weight": 0.75,
                                "weight_bytes": 4e7})
    assert cm.expert_read == pytest.approx(5e-5, rel=0.02)
    assert cm.t0 == pytest.approx(1e-3, rel=0.02)
    assert (cm.num_experts, cm.experts_per_token, cm.expert_bytes) == (16, 2, 2e6)
    assert (cm.quantization, cm.bytes_per_weight, cm.weight_bytes) == ("int4", 0.75, 4e7)
    # Dense bytes at the experts' seconds per byte: 4e7 x 5e-5 / 2e6 = 1 ms, capped at t0.
    assert cm.meta["t0_weight_read_s"] == pytest.approx(min(cm.t0, 1e-3), rel=0.02)
    assert cm.fit["heldout"]["decode"]["mean_abs_rel_error"] < 0.02
    assert cm.fit["regimes"]["all"]["mean_abs_rel_error"] < 0.02
