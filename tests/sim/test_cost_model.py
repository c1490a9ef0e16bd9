"""Cost model: the formula, presets, HF configs, persistence."""

from __future__ import annotations

import json

import pytest

from iterserve.core.outputs import SchedulerOutput
from iterserve.core.request import Request
from iterserve.core.sampling_params import SamplingParams
from iterserve.sim.cost_model import (
    HARDWARE_PRESETS,
    MODEL_PRESETS,
    CostModel,
    ModelSpec,
    get_hardware,
    get_model_spec,
    kv_cache_blocks,
    load_cost_model,
    roofline_cost_model,
)


def _out(prefill=0, decode=0, ctx=0, swap_out=0, swap_in=0, reqs=1):
    r = [Request(str(i), [1, 2, 3], SamplingParams(), 0.0) for i in range(reqs)]
    return SchedulerOutput(
        1, r, [1] * reqs, [0] * reqs, prefill + decode,
        num_prefill_tokens=prefill, num_decode_tokens=decode, num_context_tokens=ctx,
        blocks_to_swap_out=[(i, i) for i in range(swap_out)],
        blocks_to_swap_in=[(i, i) for i in range(swap_in)],
    )


def test_step_time_is_the_linear_formula():
    cm = CostModel(t0=1e-3, prefill_token=1e-5, decode_seq=2e-5, context_token=1e-7, swap_block=1e-4)
    t = cm.step_time(_out(prefill=100, decode=8, ctx=5000, swap_out=2, swap_in=1))
    assert t == pytest.approx(1e-3 + 100e-5 + 8 * 2e-5 + 5000e-7 + 3e-4)
    assert cm.time_for(100, 8, 5000, 3) == pytest.approx(t)
    # An empty step costs nothing; tau(B) = tau0 + beta*B is the a=c=s=0 case.
    empty = SchedulerOutput(1, [], [], [], 0)
    assert cm.step_time(empty) == 0.0
    tau = CostModel(t0=0.01, prefill_token=0, decode_seq=0.001, context_token=0)
    assert tau.step_time(_out(decode=16, reqs=16)) == pytest.approx(0.01 + 16 * 0.001)


def test_negative_or_nan_parameters_are_rejected():
    with pytest.raises(ValueError, match="prefill_token"):
        CostModel(t0=0, prefill_token=-1, decode_seq=0, context_token=0)
    with pytest.raises(ValueError, match="t0"):
        CostModel(t0=float("nan"), prefill_token=0, decode_seq=0, context_token=0)


def test_llama2_7b_preset_shapes():
    m = MODEL_PRESETS["llama-2-7b"]
    assert m.num_params == pytest.approx(6.74e9, rel=0.01)
    assert m.kv_bytes_per_token == 2 * 32 * 32 * 128 * 2  # 512 KiB
    cm = roofline_cost_model(m, HARDWARE_PRESETS["h100"])
    # Weights read once per step: 13.5 GB at ~2.7 TB/s is ~5 ms.
    assert 4e-3 < cm.t0 < 7e-3
    assert cm.prefill_token > 0 and cm.context_token > 0 and cm.swap_block > 0
    # H200 has more bandwidth and memory than H100: cheaper steps, more KV blocks.
    cm200 = roofline_cost_model(m, HARDWARE_PRESETS["h200"])
    assert cm200.t0 < cm.t0
    assert kv_cache_blocks(m, HARDWARE_PRESETS["h200"]) > kv_cache_blocks(m, HARDWARE_PRESETS["h100"])


def test_model_spec_from_hf_config(tmp_path):
    cfg = {
        "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 11008,
        "vocab_size": 32000, "torch_dtype": "float16", "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = ModelSpec.from_hf_config(tmp_path)
    assert spec.num_params == MODEL_PRESETS["llama-2-7b"].num_params
    assert spec.head_dim == 128 and spec.dtype_bytes == 2
    assert get_model_spec(str(tmp_path / "config.json")).num_params == spec.num_params
    # GQA: fewer KV heads, smaller KV per token.
    gqa = ModelSpec.from_hf_config({**cfg, "num_key_value_heads": 8})
    assert gqa.kv_bytes_per_token * 4 == spec.kv_bytes_per_token


def test_save_load_roundtrip(tmp_path):
    cm = roofline_cost_model(MODEL_PRESETS["bench-small"], HARDWARE_PRESETS["l4"])
    cm.fit = {"rms_rel_error": 0.03}
    path = tmp_path / "profile.json"
    cm.save(path)
    back = load_cost_model(str(path))
    assert back.params() == cm.params() and back.fit == cm.fit and back.name == cm.name
    with pytest.raises(ValueError, match="lacks"):
        CostModel.from_dict({"t0": 1.0})


def test_unknown_names_are_clear_errors():
    with pytest.raises(ValueError, match="unknown hardware"):
        get_hardware("tpu9")
    with pytest.raises(ValueError, match="unknown model"):
        get_model_spec("no-such-model")


def test_one_token_step_takes_the_lone_path():
    """With lone_t0 set, a step of exactly one token costs lone_t0 + lone_context_token
    * context (in CostModel.step_time and in the simulator's inlined copy alike)."""
    from iterserve.core.outputs import SchedulerOutput
    from iterserve.core.request import Request
    from iterserve.core.sampling_params import SamplingParams
    from iterserve.sim.executor import SimulatedExecutor

    cm = CostModel(t0=8e-3, prefill_token=1e-5, decode_seq=4e-4, context_token=5e-8,
                   lone_t0=3e-3, lone_context_token=2e-8)

    def Req() -> Request:
        return Request("r", [1] * 101, SamplingParams(max_tokens=4), 0.0)

    one = SchedulerOutput(step_id=0, scheduled_requests=[Req()], num_scheduled_tokens=[1],
                          num_computed_tokens=[100], total_num_scheduled_tokens=1,
                          num_decode_tokens=1, num_context_tokens=101)
    assert cm.step_time(one) == pytest.approx(3e-3 + 2e-8 * 101)
    ex = SimulatedExecutor(cm)
    ex.execute(one)
    assert ex.last_step_time == pytest.approx(cm.step_time(one))
    two = SchedulerOutput(step_id=1, scheduled_requests=[Req(), Req()], num_scheduled_tokens=[1, 1],
                          num_computed_tokens=[100, 100], total_num_scheduled_tokens=2,
                          num_decode_tokens=2, num_context_tokens=202)
    assert cm.step_time(two) == pytest.approx(8e-3 + 2 * 4e-4 + 202 * 5e-8)
    assert CostModel(**{**cm.to_dict(), "lone_t0": 0.0}).step_time(one) == pytest.approx(
        8e-3 + 4e-4 + 101 * 5e-8)


def test_files_without_the_one_token_regime_load_with_it_off():
    cm = CostModel.from_dict({"t0": 1e-3, "prefill_token": 1e-5, "decode_seq": 1e-4,
                              "context_token": 1e-8})
    assert cm.lone_t0 == 0.0 and cm.lone_context_token == 0.0
