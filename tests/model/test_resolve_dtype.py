"""``--dtype auto``: the checkpoint's dtype on CUDA; on CPU bf16 for bf16 / fp16
checkpoints where the CPU multiplies bf16 natively, float32 otherwise."""

from __future__ import annotations

import logging

import pytest
import torch

from iterserve.model import cpu_ops
from iterserve.model.loader import CPU_AUTO_DTYPE_ENV, resolve_dtype
from iterserve.model.model_config import ModelConfig

CPU = torch.device("cpu")
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def config(torch_dtype: str | None) -> ModelConfig:
    return ModelConfig("LlamaForCausalLM", 1, 8, 1, 1, 8, 16, 32, 4096,
                       torch_dtype=torch_dtype)


@pytest.fixture(autouse=True)
def _no_override(monkeypatch):
    monkeypatch.delenv(CPU_AUTO_DTYPE_ENV, raising=False)


# (checkpoint dtype, CPU has native bf16) -> auto's dtype
CPU_RULE = {
    ("bfloat16", True): BF16, ("bfloat16", False): FP32,
    ("float16", True): BF16, ("float16", False): FP32,
    ("float32", True): FP32, ("float32", False): FP32,
    (None, True): FP32, (None, False): FP32,
}


@pytest.mark.parametrize(("ckpt", "native"), list(CPU_RULE))
def test_cpu_auto_follows_native_bf16(monkeypatch, ckpt, native):
    monkeypatch.setattr(cpu_ops, "cpu_has_native_bf16", lambda: native)
    assert resolve_dtype("auto", config(ckpt), CPU) == CPU_RULE[ckpt, native]


@pytest.mark.parametrize("ckpt", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("native", [True, False])
def test_env_override_keeps_cpu_auto_float32(monkeypatch, ckpt, native):
    monkeypatch.setattr(cpu_ops, "cpu_has_native_bf16", lambda: native)
    monkeypatch.setenv(CPU_AUTO_DTYPE_ENV, "float32")
    assert resolve_dtype("auto", config(ckpt), CPU) == FP32
    # "auto" in the variable is the default rule
    monkeypatch.setenv(CPU_AUTO_DTYPE_ENV, "auto")
    assert resolve_dtype("auto", config(ckpt), CPU) == CPU_RULE[ckpt, native]


def test_env_override_rejects_other_values(monkeypatch):
    monkeypatch.setenv(CPU_AUTO_DTYPE_ENV, "bfloat16")
    with pytest.raises(ValueError, match=CPU_AUTO_DTYPE_ENV):
        resolve_dtype("auto", config("bfloat16"), CPU)


@pytest.mark.parametrize("native", [True, False])
def test_cuda_auto_is_the_checkpoints(monkeypatch, native):
    monkeypatch.setattr(cpu_ops, "cpu_has_native_bf16", lambda: native)
    monkeypatch.setenv(CPU_AUTO_DTYPE_ENV, "float32")  # a CPU-only override
    cuda = torch.device("cuda")
    for ckpt, want in [("bfloat16", BF16), ("float16", FP16), ("float32", FP32), (None, FP32)]:
        assert resolve_dtype("auto", config(ckpt), cuda) == want


@pytest.mark.parametrize("native", [True, False])
def test_explicit_dtype_wins(monkeypatch, native):
    monkeypatch.setattr(cpu_ops, "cpu_has_native_bf16", lambda: native)
    for name, want in [("float32", FP32), ("bfloat16", BF16), ("float16", FP16)]:
        assert resolve_dtype(name, config("bfloat16"), CPU) == want
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("fp8", config("bfloat16"), CPU)


def test_cpu_has_native_bf16_reads_the_flags(monkeypatch):
    for flags, want in [({"avx512f", "avx512_bf16"}, True), ({"amx_bf16"}, True),
                        ({"avx2", "avx512f", "avx512_vnni"}, False), (set(), False)]:
        monkeypatch.setattr(cpu_ops, "cpu_flags", lambda f=flags: set(f))
        assert cpu_ops.cpu_has_native_bf16() is want


def test_auto_logs_its_choice(monkeypatch, caplog):
    monkeypatch.setattr(cpu_ops, "cpu_has_native_bf16", lambda: True)
    with caplog.at_level(logging.INFO, logger="iterserve.model.loader"):
        resolve_dtype("auto", config("bfloat16"), CPU)
    lines = [r.getMessage() for r in caplog.records if "dtype auto" in r.getMessage()]
    assert len(lines) == 1 and "bfloat16" in lines[0] and "native bf16" in lines[0]


@pytest.mark.parametrize("ckpt", ["bfloat16", "float16"])
def test_quantized_weights_keep_float32_activations(monkeypatch, ckpt):
    monkeypatch.setattr(cpu_ops, "cpu_has_native_bf16", lambda: True)
    assert resolve_dtype("auto", config(ckpt), CPU, quantized=True) == FP32
    assert resolve_dtype("bfloat16", config(ckpt), CPU, quantized=True) == BF16  # asked for


def test_is_quantized_checkpoint(tmp_path):
    import json

    from iterserve.model.loader import is_quantized_checkpoint

    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert not is_quantized_checkpoint(tmp_path, None)
    assert is_quantized_checkpoint(tmp_path, "int8")  # --quantization at load
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}}))
    assert is_quantized_checkpoint(tmp_path, None)
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    assert is_quantized_checkpoint(tmp_path / "model.gguf", None)
