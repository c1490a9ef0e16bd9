"""compressed-tensors checkpoints: `iterserve quantize` writes them, the loader reads
pack-quantized (symmetric and with zero points) and int-quantized weights exactly as the
format defines them, greedy parity with transformers on the decoded weights, and clear
errors for what is not supported."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from iterserve import LLM, SamplingParams
from iterserve.entrypoints.cli import main
from iterserve.model.linear import Linear
from iterserve.model.quant.compressed_tensors import pack_int32, unpack_int32
from tests.model.helpers import hf_greedy, make_checkpoint, random_prompts

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ct-src")
    return path, make_checkpoint(path, "qwen2", hidden_size=128, intermediate_size=256)


def _decode_file(out_dir) -> dict[str, torch.Tensor]:
    """The written checkpoint's projections decoded with numpy, as the format reads:
    eight 4-bit values per int32, value i at bits 4i, stored as q + 8; w = q * s."""
    from safetensors.numpy import load_file

    t = load_file(str(out_dir / "model.safetensors"))
    out = {}
    for name in t:
        if name.endswith(".weight_packed"):
            prefix = name[: -len(".weight_packed")]
            rows, cols = (int(x) for x in t[f"{prefix}.weight_shape"])
            words = t[name].view(np.uint32)
            q = np.stack([(words >> (4 * i)) & 0xF for i in range(8)], axis=-1)
            q = q.reshape(rows, -1)[:, :cols].astype(np.float32) - 8
            s = t[f"{prefix}.weight_scale"].astype(np.float32)
            out[f"{prefix}.weight"] = torch.from_numpy(q * np.repeat(s, cols // s.shape[1], 1))
        elif name.endswith(".weight") and t[name].dtype == np.int8:
            s = t[name[: -len(".weight")] + ".weight_scale"].astype(np.float32)
            out[name] = torch.from_numpy(t[name].astype(np.float32) * s)
    return out


def _reference(hf, weights: dict[str, torch.Tensor]):
    import copy

    m = copy.deepcopy(hf)
    with torch.no_grad():
        sd = m.state_dict()
        for name, w in weights.items():
            sd[name].copy_(w)
    return m.eval()


@pytest.mark.parametrize(("method", "group"), [("int4", 32), ("int4", 128), ("int8", 128)])
def test_quantize_then_serve(ckpt, tmp_path, method, group):
    src, hf = ckpt
    out = tmp_path / "ct"
    assert main(["quantize", "--model", str(src), "--output", str(out), "-q", method,
                 "--group-size", str(group)]) == 0
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    assert qc["format"] == ("pack-quantized" if method == "int4" else "int-quantized")
    decoded = _decode_file(out)
    assert len(decoded) == 7 * hf.config.num_hidden_layers
    llm = LLM(str(out), dtype="float32", num_gpu_blocks=64, block_size=8)
    model = llm.engine.executor.model
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.quant is not None for m in layers if m is not model.lm_head)
    assert model.lm_head.quant is None  # "ignore": ["lm_head"]
    ref = _reference(hf, decoded)
    prompts = random_prompts([6, 25], hf.config.vocab_size, seed=7)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    got = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == [hf_greedy(ref, p, MAX_TOKENS) for p in prompts]


def test_pack_roundtrip():
    u = torch.randint(0, 16, (5, 64), dtype=torch.int16)
    assert torch.equal(unpack_int32(pack_int32(u), 64), u)
    zp = torch.randint(0, 16, (16, 3), dtype=torch.int16)
    packed_dim0 = pack_int32(zp.t().contiguous()).t()  # packed along the output rows
    assert torch.equal(unpack_int32(packed_dim0.contiguous(), 16, dim=0), zp)


def test_zero_points_decoded(ckpt, tmp_path):
    """An asymmetric pack-quantized checkpoint: w = (q - zp) * s."""
    from safetensors.torch import save_file

    src, _ = ckpt
    out = tmp_path / "asym"
    assert main(["quantize", "--model", str(src), "--output", str(out), "-q", "int4",
                 "--group-size", "32"]) == 0
    from safetensors.torch import load_file

    t = load_file(str(out / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj"
    rows, cols = (int(x) for x in t[f"{name}.weight_shape"])
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.int16)
    zp = torch.randint(0, 16, (rows, cols // 32), generator=g, dtype=torch.int16)
    s = torch.rand(rows, cols // 32, generator=g) * 0.01
    t[f"{name}.weight_packed"] = pack_int32(q)
    t[f"{name}.weight_zero_point"] = pack_int32(zp.t().contiguous()).t().contiguous()
    t[f"{name}.weight_scale"] = s
    save_file(t, str(out / "model.safetensors"))
    llm = LLM(str(out), dtype="float32", num_gpu_blocks=16, block_size=8)
    layer = llm.engine.executor.model.model.layers[0].mlp.down_proj
    want = (q.float() - zp.float().repeat_interleave(32, 1)) * s.repeat_interleave(32, 1)
    torch.testing.assert_close(layer.quant.dequantize(), want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(("patch", "match"), [
    ({"quant_method": "bitsandbytes"},
     r"method 'bitsandbytes' is not supported; supported: compressed-tensors, awq, gptq"),
    ({"format": "float-quantized"}, r"format 'float-quantized' is not supported"),
    ({"config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "tensor"}}}},
     r"strategy 'tensor' is not supported"),
    ({"config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}},
     r"only int4 / int8 weights"),
])
def test_unsupported_configs(ckpt, tmp_path, patch, match):
    src, _ = ckpt
    out = tmp_path / "bad"
    assert main(["quantize", "--model", str(src), "--output", str(out), "-q", "int8"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] |= patch
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        LLM(str(out), num_gpu_blocks=16)


def test_option_errors(ckpt, tmp_path):
    src, _ = ckpt
    with pytest.raises(ValueError, match=r"quantization .compressed-tensors.: .* is a float checkpoint"):
        LLM(str(src), quantization="compressed-tensors", num_gpu_blocks=16)
    out = tmp_path / "ct"
    assert main(["quantize", "--model", str(src), "--output", str(out)]) == 0
    with pytest.raises(ValueError, match="already quantized"):
        LLM(str(out), quantization="int4", num_gpu_blocks=16)
    assert LLM(str(out), quantization="compressed-tensors", num_gpu_blocks=16) is not None


def test_quantize_moe_checkpoint_then_serve(tmp_path):
    """A Qwen3-MoE checkpoint: the experts (per-expert gate/up/down_proj, which the
    model holds as stacked expert tensors, not Linear layers) stay float, as
    --quantization at load leaves them, so the written checkpoint loads; the attention
    and dense projections are quantized."""
    from tests.model.test_moe import make_moe_checkpoint

    src = tmp_path / "moe"
    make_moe_checkpoint(src, "qwen3_moe")
    out = tmp_path / "ct"
    assert main(["quantize", "--model", str(src), "--output", str(out), "-q", "int8"]) == 0
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    assert not [n for n in names if ".experts." in n and "scale" in n]
    assert [n for n in names if n.endswith("self_attn.q_proj.weight_scale")]
    llm = LLM(str(out), dtype="float32", num_gpu_blocks=32, block_size=8)
    sp = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4)
    assert len(llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0].token_ids) == 4


def test_quantize_error_leaves_no_output_directory(tmp_path):
    src = tmp_path / "src"
    make_checkpoint(src, "llama")  # in_features 64 / 160: not multiples of 128
    out = tmp_path / "ct"
    with pytest.raises(SystemExit, match="not a multiple of the group 128"):
        main(["quantize", "--model", str(src), "--output", str(out)])
    assert not out.exists()


def test_w8a8_activations_read_from_the_config(ckpt, tmp_path):
    """A checkpoint whose config groups quantize input activations to int8, dynamic, per
    token (llm-compressor's W8A8) runs its many-row steps as int8 GEMMs; a weight-only
    one (W8A16) does not."""
    from iterserve.model.quant.compressed_tensors import dynamic_int8_activations

    src, hf = ckpt
    out = tmp_path / "w8a8"
    assert main(["quantize", "--model", str(src), "--output", str(out), "-q", "int8"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert not dynamic_int8_activations(qc)
    for group in qc["config_groups"].values():
        group["input_activations"] = {"num_bits": 8, "type": "int", "symmetric": True,
                                      "dynamic": True, "strategy": "token"}
    assert dynamic_int8_activations(qc)
    (out / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(out), dtype="float32", num_gpu_blocks=64, block_size=8)
    model = llm.engine.executor.model
    quant = [m.quant for m in model.modules() if isinstance(m, Linear) and m.quant is not None]
    assert quant and all(q.act_dynamic_int8 for q in quant)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    outs = llm.generate(random_prompts([40], hf.config.vocab_size, seed=3), sp, use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == MAX_TOKENS
    static = dict(qc["config_groups"]["group_0"]["input_activations"], dynamic=False)
    assert not dynamic_int8_activations({"config_groups": {"g": {"input_activations": static}}})
