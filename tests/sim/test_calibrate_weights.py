"""What a calibrated runner's weights are: packed weights counted at their packed size,
a MoE model's experts apart, the format named as the simulator names it (GGUF files,
int8 / int4 at load)."""

from __future__ import annotations

import pytest

from iterserve import LLM
from iterserve.sim.calibrate_weights import quantization_name, runner_weights, weight_bytes
from iterserve.sim.cost_model import get_model_spec, roofline_cost_model
from iterserve.sim.roofline import HARDWARE_PRESETS
from iterserve.sim.weight_formats import gguf_weight_format
from tests.model.gguf_helpers import write_gguf
from tests.model.helpers import make_checkpoint
from tests.model.test_moe import make_moe_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("dense")
    hf = make_checkpoint(path, "llama", hidden_size=256, intermediate_size=512)
    return path, hf


def test_packed_weights_counted_at_their_size(ckpt):
    path, hf = ckpt
    sizes = {}
    for q in (None, "int8", "int4"):
        llm = LLM(str(path), dtype="float32", quantization=q)
        w = runner_weights(llm.engine.executor, str(path), q)
        sizes[q] = w
        assert w["quantization"] == (q or "")
    n = sum(p.numel() for p in hf.parameters())
    assert sizes[None]["weight_bytes"] == 4 * n and sizes[None]["bytes_per_weight"] == 4.0
    assert sizes["int4"]["weight_bytes"] < sizes["int8"]["weight_bytes"] < sizes[None]["weight_bytes"]
    # The projections' and the head's share: int8 a byte (and a scale per output channel).
    proj = sum(p.numel() for name, p in hf.named_parameters()
               if name.endswith("proj.weight") or name == "lm_head.weight")
    saved = sizes[None]["weight_bytes"] - sizes["int8"]["weight_bytes"]
    assert saved == pytest.approx(3 * proj, rel=0.02)


def test_moe_experts_counted_apart(tmp_path):
    hf = make_moe_checkpoint(tmp_path, "qwen3_moe")
    llm = LLM(str(tmp_path), dtype="float32")
    cfg = hf.config
    wb = weight_bytes(llm.engine.executor.model, cfg.num_experts)
    moe_layers = cfg.num_hidden_layers - len(cfg.mlp_only_layers)
    assert wb.expert_bytes == 4 * 3 * cfg.hidden_size * cfg.moe_intermediate_size * moe_layers
    total = 4 * sum(p.numel() for p in hf.parameters())
    assert wb.dense_bytes + cfg.num_experts * wb.expert_bytes == total
    # The roofline of the same config prices one expert at the same bytes.
    assert get_model_spec(str(tmp_path)).quantized(None).expert_bytes == wb.expert_bytes


def test_gguf_file_priced_at_its_tensors_bytes(ckpt, tmp_path):
    path, hf = ckpt
    f = tmp_path / "m.gguf"
    write_gguf(hf, f, path, default="Q4_K", types={"ffn_down": "Q6_K"})
    cfg, fmt = gguf_weight_format(f)
    assert cfg["hidden_size"] == 256 and cfg["num_hidden_layers"] == hf.config.num_hidden_layers
    assert fmt.name == "q4_k" and fmt.is_quantized
    # Mostly Q4_K (4.5 bits), some Q6_K, the float32 norms and the embedding's Q4_K.
    assert 144 / 256 < fmt.bytes_per_weight < 210 / 256
    assert quantization_name(str(f), "gguf") == "q4_k"
    spec = get_model_spec(str(f))
    assert spec.quantization == "q4_k" and spec.bytes_per_weight == fmt.bytes_per_weight
    float_file = tmp_path / "f.gguf"
    write_gguf(hf, float_file, path, default="F32")
    h100 = HARDWARE_PRESETS["h100"]
    assert get_model_spec(str(float_file)).quantization == ""
    assert (roofline_cost_model(spec, h100).time_for(num_decode_seqs=1)
            < roofline_cost_model(get_model_spec(str(float_file)), h100).time_for(num_decode_seqs=1))
