"""The one-pass C++ RMSNorm (with its residual add), SiLU-and-mul and RoPE of the torch
path (csrc/norm_act.cpp) against transformers' formulas in float32, bfloat16 and
float16: every element within a unit or two in the last place (a few in float32, whose
units are finer), nearly all of them equal (only the sum of squares is accumulated in
another order, and exp is another approximation); RoPE bit for bit."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from iterserve.model import cpu_ops
from iterserve.model.layers.attention import QKVAttention
from iterserve.model.layers.mlp import GatedMLP
from iterserve.model.layers.norms import GemmaRMSNorm, RMSNorm
from iterserve.model.layers.rotary import RotaryEmbedding, apply_rope
from iterserve.model.model_config import ModelConfig

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="C++ CPU kernels not built here")
HALF = [torch.bfloat16, torch.float16]
DTYPES = [torch.float32, *HALF]


def assert_close_ulp(got: torch.Tensor, ref: torch.Tensor, min_equal: float = 0.99,
                     max_ulp: int = 1) -> None:
    """Within ``max_ulp`` units in the last place everywhere (values below 1e-30 in both
    count as equal), and bit-equal in ``min_equal`` of them."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    bits = torch.int32 if got.dtype == torch.float32 else torch.int16
    a, b = got.contiguous().view(bits).long(), ref.contiguous().view(bits).long()
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


def ulps(cls: type, dtype: torch.dtype) -> int:
    """Llama's form rounds twice (the normalized row, then the weight product), so one
    unit apart in the first can be two in the second; Gemma's rounds once. In float32
    the row's scale itself (1 / sqrt of a float sum) can be a unit or two off torch's,
    and every element of the row inherits it."""
    if dtype == torch.float32:
        return 6
    return 1 if cls is GemmaRMSNorm else 2


def min_equal(dtype: torch.dtype) -> float:
    # A float32 row whose scale is one unit off torch's differs in most of its elements.
    return 0.3 if dtype == torch.float32 else 0.99


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cls,ref_cls", NORMS)
@pytest.mark.parametrize("shape", [(7, 1024), (32, 16, 128), (3, 4, 64), (2, 1000), (5, 7)])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 100.0])
@torch.no_grad()
def test_fused_rms_norm_matches_transformers(dtype, cls, ref_cls, shape, scale) -> None:
    ours, ref = _norm_pair(cls, ref_cls, shape[-1], dtype)
    x = (torch.randn(shape) * scale).to(dtype)
    assert_close_ulp(ours(x), ref(x), min_equal(dtype), max_ulp=ulps(cls, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cls,ref_cls", NORMS)
@torch.no_grad()
def test_fused_rms_norm_on_a_strided_view(dtype, cls, ref_cls) -> None:
    """Qwen3's per-head q/k norms read a view of the fused qkv output."""
    ours, ref = _norm_pair(cls, ref_cls, 128, dtype)
    qkv = torch.randn(9, 16 * 128 + 2 * 4 * 128).to(dtype)
    k = qkv[:, 16 * 128:20 * 128].view(9, 4, 128)
    assert not k.is_contiguous()
    assert_close_ulp(ours(k), ref(k.contiguous()), min_equal(dtype), max_ulp=ulps(cls, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
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
    assert_close_ulp(normed, ref(want), min_equal(dtype), max_ulp=ulps(cls, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [8, 13, 100, 688, 3072])
@pytest.mark.parametrize("scale", [0.1, 4.0, 30.0])
@torch.no_grad()
def test_silu_and_mul_matches_torch(dtype, width, scale) -> None:
    torch.manual_seed(1)
    gate_up = (torch.randn(9, 2 * width) * scale).to(dtype)
    gate, up = gate_up.split(width, dim=-1)
    f32 = dtype == torch.float32  # exp's last bits: a few float32 units
    assert_close_ulp(torch.ops.iterserve_cpu.silu_and_mul(gate_up), F.silu(gate) * up,
                     min_equal=0.8 if f32 else 0.99, max_ulp=8 if f32 else 1)


@pytest.mark.parametrize("dtype", DTYPES)
@torch.no_grad()
def test_gated_mlp_fused_equals_unfused(dtype) -> None:
    torch.manual_seed(2)
    mlp = GatedMLP(64, 96).to(dtype)
    for p in mlp.parameters():
        p.normal_(0, 0.2)
    x = torch.randn(5, 64).to(dtype)
    plain = mlp(x)
    mlp.cpu_fused = True
    # float32: the MLP's down projection sums a few-unit differences of its inputs.
    if dtype == torch.float32:
        torch.testing.assert_close(mlp(x), plain, rtol=1e-5, atol=1e-6)
    else:
        assert_close_ulp(mlp(x), plain, min_equal=0.95)


@torch.no_grad()
def test_gated_mlp_long_inputs_run_in_row_chunks(monkeypatch) -> None:
    """Rows past ``CHUNK_ROWS`` run a chunk at a time: the same rows out, in order, and
    never more than a chunk through the projections at once."""
    from iterserve.model.layers import mlp as mlp_mod

    torch.manual_seed(3)
    m = GatedMLP(32, 48)
    for p in m.parameters():
        p.normal_(0, 0.2)
    x = torch.randn(23, 32)
    whole = m(x)
    monkeypatch.setattr(mlp_mod, "CHUNK_ROWS", 5)
    seen: list[int] = []
    m.gate_up_proj.register_forward_pre_hook(lambda _m, a: seen.append(a[0].shape[0]))
    got = m(x)
    assert seen == [5, 5, 5, 5, 3]
    torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim,head_dim", [(64, 64), (32, 64), (128, 128), (20, 20), (24, 96)])
@torch.no_grad()
def test_rope_in_place_equals_apply_rope_bit_for_bit(dtype, rotary_dim, head_dim) -> None:
    """Full and partial rotary dims, on a strided view (q and k inside the fused qkv
    output), with the table RotaryEmbedding builds."""
    torch.manual_seed(3)
    rope = RotaryEmbedding(rotary_dim, 10000.0, None, 4096)
    positions = torch.tensor([0, 1, 7, 100, 4000, 33])
    cos, sin = rope(positions, dtype)
    qkv = (torch.randn(6, 7 * head_dim) * 3).to(dtype)
    qk = qkv[:, : 5 * head_dim].view(6, 5, head_dim)  # 5 of 7 heads: row stride 7 * head_dim
    want = apply_rope(qk, cos, sin)
    v_before = qkv[:, 5 * head_dim:].clone()
    torch.ops.iterserve_cpu.rope_(qk, cos, sin)
    assert torch.equal(qk, want)
    assert torch.equal(qkv[:, 5 * head_dim:], v_before)  # the rest of the row untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@torch.no_grad()
def test_qkv_attention_rope_fused_equals_unfused(dtype, qk_norm) -> None:
    """The block's q and k after RoPE (the attention backend's inputs) are the same with
    the in-place kernel as with apply_rope, with and without per-head norms."""
    cfg = ModelConfig(architecture="llama", hidden_size=64, intermediate_size=96, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=32,
                      max_position_embeddings=64)
    torch.manual_seed(4)
    block = QKVAttention(cfg, 0, qk_norm=(lambda d, eps: RMSNorm(d, eps)) if qk_norm else None)
    for p in block.parameters():
        p.normal_(0, 0.3)
    block = block.to(dtype)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    class Record(torch.nn.Module):  # the backend's place: keeps q and k
        def forward(self, q, k, v):
            seen.append((q.clone(), k.clone()))
            return q.reshape(q.shape[0], -1)

    block.attn = Record()
    rope = RotaryEmbedding(16, 10000.0, None, 64)
    table = {"default": rope(torch.arange(5), dtype)}
    x = torch.randn(5, 64).to(dtype)
    block(x, table)
    block.cpu_fused = True
    for m in block.modules():
        if isinstance(m, RMSNorm):
            m.cpu_fused = False  # only RoPE differs between the two passes
    block(x, table)
    (q0, k0), (q1, k1) = seen
    assert torch.equal(q0, q1) and torch.equal(k0, k1)


def test_fused_ops_reject_what_they_cannot_take() -> None:
    ops = torch.ops.iterserve_cpu
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        ops.rms_norm(torch.randn(2, 8).double(), torch.ones(8).double(), 1e-6)
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.rms_norm(torch.randn(2, 8).bfloat16(), torch.ones(4).bfloat16(), 1e-6)
    with pytest.raises(RuntimeError, match="residual must be"):
        ops.add_rms_norm(torch.randn(2, 8).bfloat16(), torch.randn(3, 8).bfloat16(),
                         torch.ones(8).bfloat16(), 1e-6)
    with pytest.raises(RuntimeError, match="2 \\* n"):
        ops.silu_and_mul(torch.randn(2, 7).bfloat16())
    with pytest.raises(RuntimeError, match="\\[rows, heads, d\\]"):
        ops.rope_(torch.randn(2, 8), torch.randn(2, 8), torch.randn(2, 8))
    with pytest.raises(RuntimeError, match="in x's dtype"):
        ops.rope_(torch.randn(2, 1, 8), torch.randn(2, 1, 8).bfloat16(), torch.randn(2, 1, 8))
    with pytest.raises(RuntimeError, match="rd even"):
        ops.rope_(torch.randn(2, 1, 8), torch.randn(2, 1, 10), torch.randn(2, 1, 10))


def test_which_inputs_take_the_kernel() -> None:
    """Every dtype the kernel has, the weight in the input's dtype, and only where the
    runner turned the kernels on."""
    norm = RMSNorm(16, 1e-6)
    x = torch.randn(3, 16)
    assert not norm._fused(x)  # not turned on
    norm.cpu_fused = True
    assert norm._fused(x)
    assert not norm._fused(x.double())
    assert norm._fused(x.bfloat16().requires_grad_(False)) is False  # weight is float32
    assert norm.to(torch.bfloat16)._fused(x.bfloat16())
