"""The C++ routed-experts kernel (csrc/moe_experts.cpp) against the Python path of
model/layers/moe.py on the same bfloat16 weights: the same rounding points, so equal up
to float32 summation order (at most one bfloat16 step on a few elements), for every
step size, unused experts, float32 (Mixtral) and bfloat16 (Qwen3-MoE) routing weights;
and the engine takes it for a bfloat16 MoE model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from iterserve.model import cpu_ops
from iterserve.model.layers.moe import (
    FusedMoE,
    fused_experts,
    pack_experts,
    route,
    unpack_experts,
)

pytestmark = pytest.mark.skipif(not cpu_ops.moe_available(),
                                reason="the AVX-512 MoE kernel is not built on this CPU")


def weights(e: int, inter: int, h: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).bfloat16()
    w2 = (torch.randn(e, h, inter, generator=g) / inter**0.5).bfloat16()
    return w13, w2


def check_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal but for summation order: within one bfloat16 step of the value (or of the
    block's scale, where a token's experts cancel), and exact on nearly every element."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    if not want.numel():
        return
    diff = (got.float() - want.float()).abs()
    step = want.float().abs() * 2.0**-7 + float(want.float().abs().max()) * 2.0**-8
    assert bool((diff <= step).all()), float((diff / step).max())
    if want.numel() >= 256:
        assert float((diff == 0).float().mean()) >= 0.97


def test_pack_round_trip():
    w = torch.randn(3, 48, 64).bfloat16()
    p = pack_experts(w)
    assert p.shape == (3, 3, 32, 16, 2)
    # Column c's inputs 2j, 2j + 1 sit side by side in block c // 16.
    assert torch.equal(p[1, 2, 5, 7], w[1, 2 * 16 + 7, 10:12])
    assert torch.equal(unpack_experts(p), w)


@settings(max_examples=30, deadline=None)
@given(tokens=st.integers(0, 70), experts=st.integers(1, 16), k_frac=st.floats(0.0, 1.0),
       float32_weights=st.booleans(), seed=st.integers(0, 10_000))
def test_matches_python_path(tokens, experts, k_frac, float32_weights, seed):
    h, inter = 64, 48
    k = max(1, round(k_frac * experts))
    w13, w2 = weights(experts, inter, h, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(tokens, h, generator=g).bfloat16()
    topk_w, ids = route(torch.randn(tokens, experts, generator=g), k, True,
                        torch.float32 if float32_weights else torch.bfloat16)
    want = fused_experts(x, w13, w2, topk_w, ids)
    got = torch.ops.iterserve_cpu.moe_experts(x, pack_experts(w13), pack_experts(w2), topk_w, ids)
    check_close(got, want)


# The kernel's two inner products: vdpbf16ps (where the CPU has AVX512_BF16: every step
# up to dot_max_tokens) and the pairs widened to float with two FMAs (every AVX-512 CPU).
HAS_BF16 = "avx512_bf16" in cpu_ops.cpu_flags()
DOTS = [0] + ([1 << 30] if HAS_BF16 else [])


@pytest.mark.parametrize("dot", DOTS)
@pytest.mark.parametrize("tokens", [1, 13, 100, 600])
def test_benchmark_shape(tokens, dot):
    """The benchmark model's block (hidden 1024, 32 experts of 384, top-4), from a lone
    decode to a prefill chunk: every tile remainder and many rows per expert."""
    w13, w2 = weights(32, 384, 1024, tokens)
    x = torch.randn(tokens, 1024).bfloat16()
    topk_w, ids = route(torch.randn(tokens, 32), 4, True, torch.bfloat16)
    check_close(torch.ops.iterserve_cpu.moe_experts(x, pack_experts(w13), pack_experts(w2),
                                                    topk_w, ids, dot),
                fused_experts(x, w13, w2, topk_w, ids))


@pytest.mark.skipif(not HAS_BF16, reason="the CPU lacks AVX512_BF16")
def test_the_inner_product_switches_at_dot_max_tokens():
    """Steps up to the threshold take vdpbf16ps, larger ones the FMAs: each matches the
    run forced onto its path bit for bit (the two differ in float rounding order)."""
    w13, w2 = weights(8, 48, 64, 3)
    p13, p2 = pack_experts(w13), pack_experts(w2)
    op = torch.ops.iterserve_cpu.moe_experts
    for tokens in (4, 5, 40):
        x = torch.randn(tokens, 64).bfloat16()
        topk_w, ids = route(torch.randn(tokens, 8), 2, True, torch.bfloat16)
        forced = op(x, p13, p2, topk_w, ids, 1 << 30 if tokens <= 4 else 0)
        assert torch.equal(op(x, p13, p2, topk_w, ids, 4), forced)


def test_the_block_takes_the_timed_crossover():
    from iterserve.model.layers.moe import DOT_PROBE_TOKENS, time_dot_crossover

    block = FusedMoE(64, 48, 8, 2, renormalize=True, float32_weights=False).bfloat16()
    with pytest.raises(RuntimeError, match="not packed"):
        time_dot_crossover(block)
    assert block.pack_for_cpu()
    crossover = time_dot_crossover(block, reps=1)
    assert crossover in (0, *DOT_PROBE_TOKENS)
    if not HAS_BF16:
        assert crossover == 0


def test_bad_input_is_an_error():
    w13, w2 = weights(4, 48, 64, 0)
    x = torch.randn(3, 64).bfloat16()
    topk_w, ids = route(torch.randn(3, 4), 2, True, torch.bfloat16)
    p13, p2 = pack_experts(w13), pack_experts(w2)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.iterserve_cpu.moe_experts(x, p13, p2, topk_w, ids + 4)
    with pytest.raises(RuntimeError, match="bf16"):
        torch.ops.iterserve_cpu.moe_experts(x.float(), p13, p2, topk_w, ids)
    with pytest.raises(RuntimeError, match="packed"):
        torch.ops.iterserve_cpu.moe_experts(x, w13, w2, topk_w, ids)


def test_block_packs_only_where_the_kernel_runs():
    block = FusedMoE(64, 48, 4, 2, renormalize=True, float32_weights=False).bfloat16()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(9, 64).bfloat16()
    with torch.inference_mode():
        want = block(x)
    assert block.pack_for_cpu() and block.packed and block.w13.dim() == 5
    with torch.inference_mode():
        check_close(block(x), want)
    with pytest.raises(RuntimeError, match="packed"):
        block.expert_linears()
    # float32 and awkward widths keep the Python path.
    assert not FusedMoE(64, 48, 4, 2, renormalize=True, float32_weights=False).pack_for_cpu()
    odd = FusedMoE(48, 48, 4, 2, renormalize=True, float32_weights=False).bfloat16()
    assert not odd.pack_for_cpu()
