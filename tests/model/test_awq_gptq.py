"""AWQ (GEMM) and GPTQ 4-bit checkpoints: written here in each format from integer
values (AutoAWQ's and AutoGPTQ's packing: eight 4-bit values per int32, value i at bits
4i; AWQ's output order 0 2 4 6 1 3 5 7; GPTQ's zeros stored minus one), loaded, decoded
as ``(q - z) * s``, and greedy parity with transformers on the decoded weights."""

from __future__ import annotations

import json

import pytest
import torch

from iterserve import LLM, SamplingParams
from iterserve.model.linear import Linear
from iterserve.model.quant.awq_gptq import pack_awq, pack_gptq
from tests.model.helpers import hf_greedy, make_checkpoint, random_prompts

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("awq-src")
    return path, make_checkpoint(path, "llama", hidden_size=128, intermediate_size=256)


def _awq_nibble(word: int, i: int) -> int:
    return (word >> (4 * i)) & 0xF


def test_awq_order_by_hand():
    """One word: nibble i holds output [0, 2, 4, 6, 1, 3, 5, 7][i]."""
    u = torch.arange(8, dtype=torch.int16).view(1, 8) + 1  # outputs 0..7 hold 1..8
    qw, _ = pack_awq(u, u)
    word = int(qw[0, 0]) & 0xFFFFFFFF
    assert [_awq_nibble(word, i) for i in range(8)] == [1, 3, 5, 7, 2, 4, 6, 8]
    qg, _ = pack_gptq(u.t().repeat(1, 1), u)  # in 8, out 1: inputs in order
    word = int(qg[0, 0]) & 0xFFFFFFFF
    assert [_awq_nibble(word, i) for i in range(8)] == list(range(1, 9))


def _write(src, dst, method: str, group: int, symmetric: bool):
    """``src``'s projections quantized (min/max, 4-bit) and packed in ``method``'s format;
    returns the weights they decode to, under HF names."""
    from safetensors.torch import load_file, save_file

    t = load_file(str(src / "model.safetensors"))
    out, decoded = {}, {}
    for name, w in t.items():
        prefix = name[: -len(".weight")]
        if not (name.endswith(".weight") and prefix.rsplit(".", 1)[-1] in PROJ):
            out[name] = w
            continue
        wt = w.float().t().contiguous()  # [in, out], as both formats store it
        inp, o = wt.shape
        g = wt.view(inp // group, group, o)
        if symmetric:
            s = g.abs().amax(1) / 7.5
            z = torch.full_like(s, 8, dtype=torch.int16)
        else:
            lo, hi = g.amin(1), g.amax(1)
            s = (hi - lo) / 15
            z = torch.clamp(torch.round(-lo / s), 1, 15).to(torch.int16)
        s16 = s.half()
        q = torch.clamp(torch.round(g / s16.float()[:, None]) + z[:, None], 0, 15).to(torch.int16)
        decoded[name] = ((q - z[:, None]).float() * s16.float()[:, None]).reshape(inp, o).t()
        u = q.reshape(inp, o)
        qw, qz = pack_awq(u, z) if method == "awq" else pack_gptq(u, z)
        out[f"{prefix}.qweight"], out[f"{prefix}.qzeros"] = qw, qz
        out[f"{prefix}.scales"] = s16
        if method == "gptq":
            out[f"{prefix}.g_idx"] = torch.arange(inp, dtype=torch.int32) // group
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"))
    for p in src.iterdir():
        if p.is_file() and p.suffix != ".safetensors":
            (dst / p.name).write_bytes(p.read_bytes())
    cfg = json.loads((dst / "config.json").read_text())
    qc = {"quant_method": method, "bits": 4, "group_size": group}
    qc |= ({"version": "gemm", "zero_point": True} if method == "awq"
           else {"desc_act": False, "sym": symmetric, "checkpoint_format": "gptq"})
    cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg))
    return decoded


@pytest.mark.parametrize("method", ["awq", "gptq"])
@pytest.mark.parametrize("symmetric", [False, True])
def test_greedy_equals_decoded_weights(ckpt, tmp_path, method, symmetric):
    import copy

    src, hf = ckpt
    decoded = _write(src, tmp_path / "q", method, 32, symmetric)
    llm = LLM(str(tmp_path / "q"), dtype="float32", num_gpu_blocks=64, block_size=8)
    model = llm.engine.executor.model
    for name, w in decoded.items():
        if ".self_attn.o_proj." in name or ".mlp.down_proj." in name:
            layer = model.get_submodule(name[: -len(".weight")])
            torch.testing.assert_close(layer.quant.dequantize(), w, rtol=1e-6, atol=1e-7)
            assert (layer.quant.parts[0].mins is None) == symmetric
    assert sum(isinstance(m, Linear) and m.quant is not None for m in model.modules()) == 8
    ref = copy.deepcopy(hf)
    with torch.no_grad():
        sd = ref.state_dict()
        for name, w in decoded.items():
            sd[name].copy_(w)
    prompts = random_prompts([7, 19], hf.config.vocab_size, seed=8)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    got = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == [hf_greedy(ref.eval(), p, MAX_TOKENS) for p in prompts]


@pytest.mark.parametrize(("patch", "match"), [
    ({"desc_act": True}, "desc_act true"),
    ({"bits": 8}, "8 bits is not supported"),
    ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
])
def test_unsupported_gptq(ckpt, tmp_path, patch, match):
    src, _ = ckpt
    _write(src, tmp_path / "q", "gptq", 32, True)
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    cfg["quantization_config"] |= patch
    (tmp_path / "q" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        LLM(str(tmp_path / "q"), num_gpu_blocks=16)


def test_awq_gemv_version_refused(ckpt, tmp_path):
    src, _ = ckpt
    _write(src, tmp_path / "q", "awq", 32, False)
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    cfg["quantization_config"]["version"] = "gemv"
    (tmp_path / "q" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="AWQ version 'gemv' is not supported"):
        LLM(str(tmp_path / "q"), num_gpu_blocks=16)
    with pytest.raises(ValueError, match="quantization 'gptq'"):
        LLM(str(src), quantization="gptq", num_gpu_blocks=16)
