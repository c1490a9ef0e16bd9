"""Mixture-of-experts pricing in the roofline and the cost model: a step reads the
experts its tokens are expected to touch."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from iterserve.core.outputs import SchedulerOutput
from iterserve.core.request import Request
from iterserve.core.sampling_params import SamplingParams
from iterserve.sim.cost_model import (
    HARDWARE_PRESETS,
    MODEL_PRESETS,
    CostModel,
    ModelSpec,
    expected_active_experts,
    roofline_cost_model,
)
from iterserve.sim.executor import SimulatedExecutor

H100 = HARDWARE_PRESETS["h100"]


@given(e=st.integers(1, 256), k_frac=st.floats(0.0, 1.0), n=st.integers(0, 5000))
def test_active_experts_monotone_and_saturating(e, k_frac, n):
    k = max(1, round(k_frac * e))
    a, b = expected_active_experts(n, e, k), expected_active_experts(n + 1, e, k)
    assert 0.0 <= a <= b <= e + 1e-9
    assert a <= n * k + 1e-9  # never more than the assignments
    if n == 1:
        assert a == pytest.approx(k)  # one token: exactly its k experts


def test_active_experts_limits():
    assert expected_active_experts(0, 128, 8) == 0.0
    assert expected_active_experts(100_000, 128, 8) == pytest.approx(128)
    assert expected_active_experts(7, 1, 1) == 1.0
    # Two tokens with top-2 of 4: each expert is missed by both with p = 1/4.
    assert expected_active_experts(2, 4, 2) == pytest.approx(4 * (1 - 0.25))


def test_qwen3_30b_a3b_preset():
    m = MODEL_PRESETS["qwen3-30b-a3b"]
    assert m.num_params == pytest.approx(30.5e9, rel=0.01)
    assert m.active_params == pytest.approx(3.3e9, rel=0.03)
    assert m.weight_bytes == 2 * m.num_params  # the KV budget is what all experts leave
    cm = roofline_cost_model(m, H100)
    assert cm.num_experts == 128 and cm.experts_per_token == 8
    # Decode of one sequence reads ~8 experts, a 2048-token chunk all 128.
    one = cm.time_for(num_decode_seqs=1) - cm.time_for(num_decode_seqs=1, num_tokens=0)
    assert one == pytest.approx(8 * cm.expert_read)
    full = cm.time_for(num_prefill_tokens=2048) - cm.time_for(num_prefill_tokens=2048,
                                                              num_tokens=0)
    assert full == pytest.approx(128 * cm.expert_read, rel=1e-6)
    # A single decode is far cheaper than reading all 30B parameters.
    assert cm.time_for(num_decode_seqs=1) < 0.3 * (m.weight_bytes / (H100.mem_bandwidth * 0.8))


def test_dense_presets():
    q8 = MODEL_PRESETS["qwen3-8b"]
    assert q8.num_params == pytest.approx(8.19e9, rel=0.01)
    g4 = MODEL_PRESETS["gemma-3-4b"]
    assert g4.num_params == pytest.approx(3.88e9, rel=0.02)  # the language model's share
    assert g4.kv_bytes_per_token == 2 * 34 * 4 * 256 * 2
    for m in (q8, g4):
        assert m.active_params == m.num_params and m.expert_bytes == 0
        assert roofline_cost_model(m, H100).expert_time(1000) == 0.0


def _spec(**kw) -> ModelSpec:
    return ModelSpec("m", 1024, 8, 16, 4, 64, 2816, 32000, dtype="bfloat16", **kw)


def _step(n: int, tokens_each: int, computed: int) -> SchedulerOutput:
    reqs = [Request(str(i), list(range(3, 3 + computed + tokens_each)), SamplingParams(), 0.0)
            for i in range(n)]
    total = n * tokens_each
    decode = total if tokens_each == 1 else 0
    return SchedulerOutput(1, reqs, [tokens_each] * n, [computed] * n, total,
                           num_prefill_tokens=total - decode, num_decode_tokens=decode,
                           num_context_tokens=n * (computed + tokens_each))


def _steps() -> list[SchedulerOutput]:
    """Decode batches of 1, 4 and 64 at context 100, then one 512-token prefill chunk."""
    return [_step(n, 1, 100) for n in (1, 4, 64)] + [_step(1, 512, 0)]


def test_one_expert_top1_prices_as_dense():
    """E = k = 1 with the dense MLP's size is the dense model (plus a 1-wide router)."""
    dense = roofline_cost_model(_spec(), H100)
    moe = roofline_cost_model(_spec(num_experts=1, num_experts_per_tok=1,
                                     moe_intermediate_size=2816), H100)
    for so in _steps():
        assert moe.step_time(so) == pytest.approx(dense.step_time(so), rel=1e-4)


def test_step_time_grows_with_tokens_and_saturates():
    cm = roofline_cost_model(_spec(num_experts=32, num_experts_per_tok=4,
                                   moe_intermediate_size=512), H100)
    reads = [cm.expert_time(n) for n in (1, 2, 8, 64, 4096)]
    assert reads == sorted(reads)
    assert reads[0] == pytest.approx(4 * cm.expert_read)
    assert reads[-1] == pytest.approx(32 * cm.expert_read)
    times = [cm.step_time(so) for so in _steps()[:3]]
    assert times == sorted(times)


def test_simulated_executor_charges_experts():
    cm = roofline_cost_model(MODEL_PRESETS["qwen3-30b-a3b"], H100)
    ex = SimulatedExecutor(cm)
    for so in _steps():
        ex.execute(so)
        assert ex.last_step_time == pytest.approx(cm.step_time(so))


def test_from_hf_config_reads_experts(tmp_path):
    qwen = {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48,
            "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
            "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
            "num_experts_per_tok": 8, "vocab_size": 151936, "torch_dtype": "bfloat16",
            "mlp_only_layers": [], "decoder_sparse_step": 1}
    spec = ModelSpec.from_hf_config(qwen)
    assert spec.num_params == MODEL_PRESETS["qwen3-30b-a3b"].num_params
    # Two layers dense: their MLP is the dense one, the rest experts.
    part = ModelSpec.from_hf_config({**qwen, "mlp_only_layers": [0, 47]})
    assert part.moe_layers == 46
    assert ModelSpec.from_hf_config({**qwen, "decoder_sparse_step": 2}).moe_layers == 24
    mixtral = {"model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32,
               "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
               "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000}
    (tmp_path / "config.json").write_text(json.dumps(mixtral))
    m = ModelSpec.from_hf_config(tmp_path)
    assert m.num_params == pytest.approx(46.7e9, rel=0.01)
    assert m.active_params == pytest.approx(12.9e9, rel=0.01)


def test_bad_expert_fields():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        _spec(num_experts=4, num_experts_per_tok=5, moe_intermediate_size=8)
    with pytest.raises(ValueError, match="experts_per_token"):
        CostModel(t0=0, prefill_token=0, decode_seq=0, context_token=0, num_experts=4,
                  experts_per_token=0)


def test_save_load_keeps_experts(tmp_path):
    cm = roofline_cost_model(MODEL_PRESETS["qwen3-30b-a3b"], H100)
    cm.save(tmp_path / "p.json")
    back = CostModel.load(tmp_path / "p.json")
    assert (back.expert_read, back.num_experts, back.experts_per_token) == (
        cm.expert_read, 128, 8)
    so = _steps()[0]
    assert back.step_time(so) == pytest.approx(cm.step_time(so))
