"""--quantization int8 / int4 at load: greedy parity with transformers on the weights
the quantization decodes to, and the option's errors."""

from __future__ import annotations

import pytest
import torch

from iterserve import LLM, SamplingParams
from iterserve.config import EngineConfig
from iterserve.model.linear import Linear
from iterserve.model.quant.packed import quantize_int4, quantize_int8
from tests.model.helpers import hf_greedy, make_checkpoint, random_prompts

MAX_TOKENS = 8
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("qload")
    return path, make_checkpoint(path, "qwen2", hidden_size=128, intermediate_size=256)


def _reference(hf, method: str, group: int):
    import copy

    m = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(".weight") and any(f".{x}." in name for x in PROJ):
                q = quantize_int8(p) if method == "int8" else quantize_int4(p, group)
                p.copy_(q.dequantize())
        m.lm_head.weight.copy_(quantize_int8(m.lm_head.weight).dequantize())
    return m.eval()


@pytest.mark.parametrize(("method", "group"), [("int8", 32), ("int4", 32), ("int4", 64),
                                               ("int4", 128)])
def test_greedy_equals_dequantized_model(ckpt, method, group):
    path, hf = ckpt
    llm = LLM(str(path), dtype="float32", quantization=method, quantization_group_size=group,
              num_gpu_blocks=64, block_size=8)
    model = llm.engine.executor.model
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.quant is not None for m in layers)
    bits = {p.bits for m in layers if m is not model.lm_head for p in m.quant.parts}
    assert bits == ({8} if method == "int8" else {4})
    ref = _reference(hf, method, group)
    prompts = random_prompts([4, 21], hf.config.vocab_size, seed=6)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(ref, p, MAX_TOKENS) for p in prompts]


def test_bfloat16_model_quantized(ckpt):
    path, _ = ckpt
    llm = LLM(str(path), dtype="bfloat16", quantization="int4", num_gpu_blocks=64, block_size=8)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4,
                                                    min_tokens=4), use_tqdm=False)[0]
    assert len(out.token_ids) == 4


def test_quantization_option_errors(ckpt, tmp_path):
    with pytest.raises(ValueError, match=r"'fp8'.*not supported by iterserve; supported: gguf, compressed-tensors, awq"):
        EngineConfig(quantization="fp8")
    with pytest.raises(ValueError, match=r"quantization must be one of"):
        EngineConfig(quantization="fp3")
    with pytest.raises(ValueError, match=r"quantization_group_size must be one of"):
        EngineConfig(quantization="int4", quantization_group_size=48)
    path, _ = ckpt
    with pytest.raises(ValueError, match=r"'gguf' needs a \.gguf model file"):
        LLM(str(path), quantization="gguf", num_gpu_blocks=16)
