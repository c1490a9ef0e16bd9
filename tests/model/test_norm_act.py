"""The one-pass C++ RMSNorm (with its residual add) and SiLU-and-mul of the torch path
(csrc/norm_act.cpp) against transformers' formulas in bfloat16 and float16: every
element within one unit in the last place, nearly all of them equal (only the sum of
squares is accumulated in another order)."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from iterserve.model import cpu_ops
from iterserve.model.layers.mlp import GatedMLP
from iterserve.model.layers.norms import GemmaRMSNorm, RMSNorm

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="C++ CPU kernels not built here")
HALF = [torch.bfloat16, torch.float16]


def assert_close_ulp(got: torch.Tensor, ref: torch.Tensor, min_equal: float = 0.99,
                     max_ulp: int = 1) -> None:
    """Within ``max_ulp`` units in the last place everywhere (values below 1e-30 in both
    count as equal), and bit-equal in ``min_equal`` of them."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    a, b = got.contiguous().view(torch.int16).int(), ref.contiguous().view(torch.int16).int()
    diff = (a - b).abs()
    diff[(got.float().abs() < 1e-30) & (ref.float().abs() < 1e-30)] = 0
    assert int(diff.max()) <= max_ulp, f"{int(diff.max())} ulp apart"
    assert float((diff == 0).float().mean()) >= min_equal


def _norm_pair(cls: type, ref_cls: type, hidden: int, dtype: torch.dtype):
    torch.manual_seed(0)
    ours, ref = cls(hidden, eps=1e-6), ref_cls(hidden, eps=1e-6)
    w = torch.randn(hidden) * 0.5
    with torch.no_grad():
        ours.weight.copy_(w)
        ref.weight.copy_(w)
    ours, ref = ours.to(dtype), ref.to(dtype)
    ours.cpu_fused = True
    return ours, ref


NORMS = [(RMSNorm, LlamaRMSNorm), (GemmaRMSNorm, Gemma3RMSNorm)]


def ulps(cls: type) -> int:
    """Llama's form rounds twice (the normalized row, then the weight product), so one
    unit apart in the first can be two in the second; Gemma's rounds once."""
    return 1 if cls is GemmaRMSNorm else 2


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("cls,ref_cls", NORMS)
@pytest.mark.parametrize("shape", [(7, 1024), (32, 16, 128), (3, 4, 64), (2, 1000), (5, 7)])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 100.0])
@torch.no_grad()
def test_fused_rms_norm_matches_transformers(dtype, cls, ref_cls, shape, scale) -> None:
    ours, ref = _norm_pair(cls, ref_cls, shape[-1], dtype)
    x = (torch.randn(shape) * scale).to(dtype)
    assert_close_ulp(ours(x), ref(x), max_ulp=ulps(cls))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("cls,ref_cls", NORMS)
@torch.no_grad()
def test_fused_rms_norm_on_a_strided_view(dtype, cls, ref_cls) -> None:
    """Qwen3's per-head q/k norms read a view of the fused qkv output."""
    ours, ref = _norm_pair(cls, ref_cls, 128, dtype)
    qkv = torch.randn(9, 16 * 128 + 2 * 4 * 128).to(dtype)
    k = qkv[:, 16 * 128:20 * 128].view(9, 4, 128)
    assert not k.is_contiguous()
    assert_close_ulp(ours(k), ref(k.contiguous()), max_ulp=ulps(cls))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("cls,ref_cls", NORMS)
@pytest.mark.parametrize("hidden", [64, 1000, 2048])
@torch.no_grad()
def test_add_forward_adds_in_place_then_normalizes(dtype, cls, ref_cls, hidden) -> None:
    ours, ref = _norm_pair(cls, ref_cls, hidden, dtype)
    residual = torch.randn(11, hidden).to(dtype)
    delta = (torch.randn(11, hidden) * 3).to(dtype)
    want = residual + delta  # the model dtype's sum, as transformers adds
    x = residual.clone()
    new, normed = ours.add_forward(delta, x)
    assert new.data_ptr() == x.data_ptr()  # in place
    assert torch.equal(new, want)
    assert_close_ulp(normed, ref(want), max_ulp=ulps(cls))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("width", [8, 13, 100, 688, 3072])
@pytest.mark.parametrize("scale", [0.1, 4.0, 30.0])
@torch.no_grad()
def test_silu_and_mul_matches_torch(dtype, width, scale) -> None:
    torch.manual_seed(1)
    gate_up = (torch.randn(9, 2 * width) * scale).to(dtype)
    gate, up = gate_up.split(width, dim=-1)
    assert_close_ulp(torch.ops.iterserve_cpu.silu_and_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", HALF)
@torch.no_grad()
def test_gated_mlp_fused_equals_unfused(dtype) -> None:
    torch.manual_seed(2)
    mlp = GatedMLP(64, 96).to(dtype)
    for p in mlp.parameters():
        p.normal_(0, 0.2)
    x = torch.randn(5, 64).to(dtype)
    plain = mlp(x)
    mlp.cpu_fused = True
    assert_close_ulp(mlp(x), plain, min_equal=0.95)


def test_fused_ops_reject_what_they_cannot_take() -> None:
    ops = torch.ops.iterserve_cpu
    with pytest.raises(RuntimeError, match="bfloat16 or float16"):
        ops.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.rms_norm(torch.randn(2, 8).bfloat16(), torch.ones(4).bfloat16(), 1e-6)
    with pytest.raises(RuntimeError, match="residual must be"):
        ops.add_rms_norm(torch.randn(2, 8).bfloat16(), torch.randn(3, 8).bfloat16(),
                         torch.ones(8).bfloat16(), 1e-6)
    with pytest.raises(RuntimeError, match="2 \\* n"):
        ops.silu_and_mul(torch.randn(2, 7).bfloat16())


def test_float32_and_unfused_keep_the_torch_formula() -> None:
    """float32 (the C++ decoder's and transformers' bit-exact path) never takes the kernel."""
    norm = RMSNorm(16, 1e-6)
    norm.cpu_fused = True
    x = torch.randn(3, 16)
    assert not norm._fused(x)
    assert norm._fused(x.bfloat16().requires_grad_(False)) is False  # weight is float32
    assert norm.to(torch.bfloat16)._fused(x.bfloat16())
