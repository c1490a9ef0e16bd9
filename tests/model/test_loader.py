"""Checkpoint loading: architectures, dtypes, weight mapping, logits vs transformers."""

from __future__ import annotations

import json

import pytest
import torch

from iterserve.config import CacheConfig
from iterserve.core.outputs import SchedulerOutput
from iterserve.core.request import Request
from iterserve.core.sampling_params import SamplingParams
from iterserve.model.default_model import ensure_random_model
from iterserve.model.loader import load_model, resolve_model_path
from iterserve.model.model_config import ModelConfig
from iterserve.model.runner import ModelRunner, determine_num_gpu_blocks
from tests.model.helpers import hf_logits, make_checkpoint, random_prompts


def prefill_logits(path, prompt: list[int], dtype=torch.float32) -> torch.Tensor:
    """All-position logits from our runner path: one prefill step, every row projected."""
    model, _ = load_model(path, dtype, torch.device("cpu"))
    runner = ModelRunner(model, CacheConfig(block_size=4, num_gpu_blocks=64))
    req = Request("r", prompt, SamplingParams(), 0.0)
    req.block_ids = list(range(-(-len(prompt) // 4)))
    step = runner.step_layout.plan([len(prompt)], [0])
    x = runner.inputs.build(step, [req], [len(prompt)], [0])
    from iterserve.model.attention import forward_context

    with torch.inference_mode(), forward_context(x.meta):
        return model.compute_logits(model(x.input_ids, x.positions))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_logits_match_hf(arch, request):
    path, hf = request.getfixturevalue(f"{arch}_ckpt")
    prompt = random_prompts([37], hf.config.vocab_size)[0]
    ours = prefill_logits(path, prompt)
    assert torch.allclose(ours, hf_logits(hf, prompt), atol=1e-4, rtol=1e-4)


def test_qwen2_biases_loaded(qwen2_ckpt):
    path, hf = qwen2_ckpt
    model, cfg = load_model(path, torch.float32, torch.device("cpu"))
    assert cfg.attention_bias
    attn = model.model.layers[0].self_attn
    ref = hf.model.layers[0].self_attn
    q = cfg.num_heads * cfg.head_dim
    assert torch.equal(attn.qkv_proj.bias[:q], ref.q_proj.bias)
    assert attn.o_proj.bias is None


def test_tied_embeddings_and_llama3_rope(tmp_path):
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    hf = make_checkpoint(tmp_path, "llama", tie=True, rope_parameters=rope)
    model, cfg = load_model(tmp_path, torch.float32, torch.device("cpu"))
    assert cfg.tie_word_embeddings and cfg.rope_scaling["rope_type"] == "llama3"
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())
    prompt = random_prompts([150], hf.config.vocab_size)[0]  # past the original 64 positions
    assert torch.allclose(prefill_logits(tmp_path, prompt), hf_logits(hf, prompt), atol=1e-4)


def test_bfloat16_load_is_close(llama_ckpt):
    path, hf = llama_ckpt
    model, _ = load_model(path, torch.bfloat16, torch.device("cpu"))
    assert next(model.parameters()).dtype == torch.bfloat16
    prompt = random_prompts([20], hf.config.vocab_size)[0]
    ours = prefill_logits(path, prompt, torch.bfloat16)
    ref = hf_logits(hf, prompt)
    # bf16 has ~3 significant digits: compare the distributions loosely.
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8


def test_unknown_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(ValueError, match=r"LlamaForCausalLM.*MistralForCausalLM.*Qwen2ForCausalLM"):
        load_model(tmp_path, torch.float32, torch.device("cpu"))


def test_missing_weights_and_bad_paths(tmp_path, llama_ckpt):
    path, _ = llama_ckpt
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ValueError, match="safetensors"):
        load_model(tmp_path, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        resolve_model_path(str(tmp_path / "nope"))


def test_mistral_config_sliding_window():
    cfg = ModelConfig.from_hf_config(
        {
            "architectures": ["MistralForCausalLM"],
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "vocab_size": 32000,
            "max_position_embeddings": 32768,
            "sliding_window": 4096,
            "rope_theta": 10000.0,
        }
    )
    from iterserve.model.loader import max_model_len_for

    # The window is attended as such (every layer), so the position limit is the bound.
    assert cfg.head_dim == 128 and max_model_len_for(cfg) == 32768
    assert cfg.all_layers_sliding and cfg.layer_sliding_window(31) == 4096
    assert 7.0e9 < cfg.num_params < 7.5e9


def test_kv_sizing():
    cfg = ModelConfig.from_hf_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "hidden_size": 512,
            "intermediate_size": 1408,
            "num_hidden_layers": 8,
            "vocab_size": 32000,
        }
    )
    per_block = cfg.kv_bytes_per_block(16, 4)
    assert per_block == 16 * 2 * 8 * 4 * 64 * 4
    cc = CacheConfig(kv_cache_memory=per_block * 10 + 5)
    assert determine_num_gpu_blocks(cfg, cc, torch.float32, "cpu") == 10
    assert determine_num_gpu_blocks(cfg, CacheConfig(num_gpu_blocks=7), torch.float32, "cpu") == 7
    auto = determine_num_gpu_blocks(
        cfg, CacheConfig(), torch.float32, "cpu", max_num_seqs=4, max_model_len=100
    )
    assert auto == 4 * 7  # never more than every sequence at full length
    with pytest.raises(ValueError, match="kv_cache_memory"):
        determine_num_gpu_blocks(cfg, CacheConfig(kv_cache_memory=100), torch.float32, "cpu")


def test_random_model_builds_once_and_loads(tmp_path):
    path = ensure_random_model(tmp_path)
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_random_model(tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    model, cfg = load_model(path, torch.float32, torch.device("cpu"))
    assert cfg.tie_word_embeddings and cfg.eos_token_ids
    # Deterministic from the seed: a second build elsewhere has identical weights.
    other, _ = load_model(ensure_random_model(tmp_path / "b"), torch.float32, torch.device("cpu"))
    for (n, a), (_, b) in zip(model.named_parameters(), other.named_parameters()):
        assert torch.equal(a, b), n


def test_runner_handles_empty_and_swap_only_steps(llama_ckpt):
    path, _ = llama_ckpt
    model, _ = load_model(path, torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, CacheConfig(block_size=4, num_gpu_blocks=8, swap_space=4))
    runner.kv_cache[:, :, 3] = 1.5
    out = runner.execute(SchedulerOutput(0, [], [], [], 0, blocks_to_swap_out=[(3, 1)]))
    assert out.sampled_token_ids == {}
    assert torch.all(runner.host_kv_cache[:, :, 1] == 1.5)
    runner.execute(SchedulerOutput(1, [], [], [], 0, blocks_to_swap_in=[(1, 6)]))
    assert torch.all(runner.kv_cache[:, :, 6] == 1.5)


def test_building_a_model_imports_no_compiler_stack():
    # On meta tensors, nn.init.normal_ and to_empty's empty_like run torch's Python
    # references, which import torch._dynamo and sympy: ~115 MiB resident in every
    # serving process. A fresh interpreter, since this one may have imported them already.
    import subprocess
    import sys

    code = """
import sys, torch
from iterserve.model.loader import _empty_model
from iterserve.model.model_config import ModelConfig
cfg = ModelConfig.from_hf_config({"architectures": ["LlamaForCausalLM"],
    "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 256,
    "max_position_embeddings": 128})
pre = {m for m in ("sympy", "torch._dynamo") if m in sys.modules}
model = _empty_model(cfg, torch.float32, torch.device("cpu"))
assert model.model.embed_tokens.weight.shape == (256, 64)
assert all(p.device.type == "cpu" for p in model.parameters())
print(sorted(pre), sorted(m for m in ("sympy", "torch._dynamo") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip().splitlines()[-1]
    assert out == "[] []", out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_loading_a_tokenizer_imports_no_model_config_class(arch, request):
    """``AutoConfig`` would import the model's config class, and with it transformers'
    image utilities and sympy (~70 MB in every serving process): the tokenizer is
    loaded on the base config, and is the one ``AutoTokenizer`` alone picks."""
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from iterserve.model.loader import load_tokenizer

    ckpt = request.getfixturevalue(f"{arch}_ckpt")[0]
    want = AutoTokenizer.from_pretrained(str(ckpt))
    got = load_tokenizer(ckpt)
    assert type(got) is type(want)
    text = "Hello world, 123 test"
    assert got(text)["input_ids"] == want(text)["input_ids"]
    code = f"""
import sys
from iterserve.model.loader import load_tokenizer
load_tokenizer({str(ckpt)!r})
print(sorted(m for m in ("sympy", "torch._dynamo") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip().splitlines()[-1]
    assert out == "[]", out
