"""The packed quantized layouts and their kernels (model/quant/packed.py,
csrc/quant_gemm.cpp) against dequantize-then-F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from iterserve.model import cpu_ops
from iterserve.model.linear import Linear, set_quant
from iterserve.model.quant.packed import (
    QuantTensor,
    QuantWeight,
    linear_torch,
    pack4,
    pack6,
    quantize_int4,
    quantize_int8,
    unpack6,
)


def _assert_int8_activation_product(got: torch.Tensor, x: torch.Tensor,
                                    t: QuantTensor) -> None:
    """The int8-activation kernels' result: F.linear of the dequantized weight with the
    input as the kernel quantizes it (the mins' share taken with the float input), and
    within the activation quantization's error (about 0.4% of the output's scale) of the
    float input's product."""
    w = t.dequantize().double()
    xq = _q8_input(x).double()
    exact = F.linear(xq, w)
    if t.mins is not None:  # w = s q - m: the kernel's m . x uses x itself
        minus_m = QuantTensor(t.bits, torch.zeros_like(t.qweight), t.scales, t.mins, t.group,
                              t.scale_base, t.min_base).dequantize().double()
        exact = exact - F.linear(xq - x.double(), minus_m)
    exact = exact.float()
    torch.testing.assert_close(got, exact, rtol=1e-4, atol=1e-4 * float(exact.abs().max()))
    want = F.linear(x.double(), w).float()
    assert float((got - want).abs().max()) < 0.02 * float(want.abs().max())


def _random(bits: int, out: int, inp: int, group: int, scale_dtype, mins: bool,
            seed: int = 0) -> QuantTensor:
    g = torch.Generator().manual_seed(seed)
    if bits == 8:
        q = torch.randint(-128, 128, (out, inp), generator=g, dtype=torch.int8)
    elif bits == 6:
        q = pack6(torch.randint(0, 64, (out, inp), generator=g, dtype=torch.uint8))
    else:
        q = pack4(torch.randint(0, 16, (out, inp), generator=g, dtype=torch.uint8))
    if scale_dtype in (torch.uint8, torch.int8):  # two-level, as the K-quants
        lo = 1 if scale_dtype == torch.uint8 else -127
        s = torch.randint(lo, 64, (out, inp // group), generator=g, dtype=scale_dtype)
        m = torch.randint(0, 64, (out, inp // group), generator=g, dtype=scale_dtype)
        # float16 bases under 6-bit codes (Q6_K's d), float32 under the others (Q4_K's)
        bd = torch.float16 if bits == 6 else torch.float32
        sb = (torch.rand(out, inp // 256, generator=g) * 1e-3).to(bd)
        mb = (torch.rand(out, inp // 256, generator=g) * 1e-3).to(bd)
        return QuantTensor(bits, q, s, m if mins else None, group, sb, mb if mins else None)
    s = (torch.rand(out, inp // group, generator=g) * 0.02 + 0.001).to(scale_dtype)
    m = (torch.rand(out, inp // group, generator=g) * 0.05).to(scale_dtype) if mins else None
    return QuantTensor(bits, q, s, m, group)


def _op(x: torch.Tensor, t: QuantTensor, few_rows: int = 8, kernel: int = 0) -> torch.Tensor:
    return torch.ops.iterserve_cpu.quant_linear(x, t.qweight, t.scales, t.mins, t.scale_base,
                                                t.min_base, t.bits, t.group, few_rows, kernel)


LAYOUTS = [
    (8, 32, torch.float16, False),  # Q8_0
    (6, 16, torch.int8, False),  # Q6_K
    (6, 16, torch.float32, False),
    (6, 64, torch.float16, False),
    (8, 16, torch.int8, False),
    (8, 16, torch.float32, False),
    (8, 32, torch.float32, True),
    (4, 32, torch.float16, False),  # Q4_0
    (4, 32, torch.uint8, True),  # Q4_K
    (4, 32, torch.float32, True),
    (4, 128, torch.float32, True),  # int4 group 128
]

needs_kernel = pytest.mark.skipif(not cpu_ops.quant_available(),
                                  reason="AVX-512 quantized kernels not built here")


def test_pack4_layout():
    q = torch.arange(32, dtype=torch.uint8).remainder(16).view(1, 32)
    packed = pack4(q)
    assert packed.shape == (1, 16)
    assert int(packed[0, 0]) == (0 | (0 << 4))  # element 0 and element 16 (=0 mod 16)
    assert int(packed[0, 3]) == (3 | (3 << 4))
    t = QuantTensor(4, packed, torch.ones(1, 1), torch.zeros(1, 1), 32)
    assert torch.equal(t.dequantize(), q.float())


def test_pack6_layout():
    """Per 64 elements: 32 bytes of low nibbles (j | j + 32), 16 of top bit pairs
    (j, j + 16, j + 32, j + 48); the torch dequantization reads them back."""
    q = torch.arange(128, dtype=torch.uint8).remainder(64).view(1, 128)
    packed = pack6(q)
    assert packed.shape == (1, 96) and packed.dtype == torch.uint8
    assert int(packed[0, 5]) == (5 | ((37 & 15) << 4))  # low nibbles of elements 5, 37
    # top bits of elements 5, 21, 37, 53: 0, 1, 2, 3
    assert int(packed[0, 32 + 5]) == (0 | (1 << 2) | (2 << 4) | (3 << 6))
    t = QuantTensor(6, packed, torch.ones(1, 8), None, 16)
    assert torch.equal(t.dequantize(), q.float() - 32)
    assert t.nbytes == 96 + 8 * 4


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 40])
def test_torch_fallback_matches_reference(layout, rows):
    t = _random(*layout[:1], 96, 512, *layout[1:])
    x = torch.randn(rows, 512)
    torch.testing.assert_close(linear_torch(x, t), F.linear(x, t.dequantize()),
                               rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kernel_dequantize_is_exact(layout):
    t = _random(layout[0], 48, 512, *layout[1:])
    got = torch.ops.iterserve_cpu.quant_dequantize(t.qweight, t.scales, t.mins, t.scale_base,
                                                   t.min_base, t.bits, t.group)
    torch.testing.assert_close(got, t.dequantize(), rtol=1e-6, atol=1e-7)


@needs_kernel
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 64])
def test_kernel_matches_dequantized_linear(layout, rows):
    t = _random(layout[0], 200, 768, *layout[1:], seed=rows)
    x = torch.randn(rows, 768)
    want = F.linear(x.double(), t.dequantize().double()).float()
    got = _op(x, t)
    # float32 sums in another order than a float64 reference: relative to the output scale.
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


needs_vnni = pytest.mark.skipif(not cpu_ops.vnni_available(), reason="no AVX-512 VNNI")


def _q8_input(x: torch.Tensor) -> torch.Tensor:
    """x as the int8-activation kernel sees it: per 32 elements, scale amax / 127, round
    to nearest (even)."""
    b = x.view(x.shape[0], -1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    # float32, as the kernel: x * (127 / amax), a true division (``127.0 / t`` is
    # torch's reciprocal times 127, an ulp off at times, which moves ties).
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, 0.0)
    return (torch.round(b * inv) * (amax / 127.0)).view_as(x)


@needs_vnni
@pytest.mark.parametrize("layout", [*LAYOUTS, (8, 768, torch.float32, False),  # int8 per channel
                                    (4, 64, torch.float16, False)])
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 8])
def test_int8_activation_kernel(layout, rows):
    """The VNNI kernel equals F.linear of the dequantized weight with the input
    quantized as it quantizes it (float32 summation order apart; the mins' share taken
    with the float input), and is within the activation quantization's error of the
    float input's product: per element an error of at most amax / 254 of its 32-block,
    about 0.4% of the output's scale here."""
    t = _random(layout[0], 200, 768, *layout[1:], seed=rows)
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows))
    got = _op(x, t, kernel=1)
    _assert_int8_activation_product(got, x, t)


@needs_vnni
def test_int8_activation_kernel_rejects_layouts_it_cannot_take():
    t = _random(8, 16, 96, 32, torch.float32, False)  # 96: not whole 64-element chunks
    with pytest.raises(RuntimeError, match="int8-activation"):
        _op(torch.randn(1, 96), t, kernel=1)


@needs_kernel
def test_tiled_path_covers_every_row():
    t = _random(4, 1000, 256, 32, torch.float32, True)  # several tiles, a ragged last one
    x = torch.randn(17, 256)
    got = _op(x, t)
    want = F.linear(x, t.dequantize())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


@pytest.mark.parametrize("use_cpp", [False, True])
def test_linear_with_mixed_parts_and_bias(use_cpp):
    if use_cpp and not cpu_ops.quant_available():
        pytest.skip("AVX-512 quantized kernels not built here")
    a = _random(4, 64, 128, 32, torch.float32, True, seed=1)
    b = _random(8, 32, 128, 16, torch.float32, False, seed=2)
    c = _random(4, 16, 128, 32, torch.float32, True, seed=3)
    d = _random(6, 48, 128, 16, torch.float32, False, seed=4)
    qw = QuantWeight([a, c, b, d], use_cpp=use_cpp)
    assert len(qw.parts) == 3  # a and c stacked
    layer = Linear(128, 160, bias=True)
    set_quant(layer, qw)
    x = torch.randn(3, 128)
    w = torch.cat([a.dequantize(), c.dequantize(), b.dequantize(), d.dequantize()])
    want = F.linear(x, w, layer.bias.detach())
    torch.testing.assert_close(layer(x).detach(), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    xb = x.bfloat16()
    assert layer(xb).dtype == torch.bfloat16


def test_set_quant_checks_shape():
    layer = Linear(128, 64, bias=False)
    with pytest.raises(ValueError, match="does not fit"):
        set_quant(layer, QuantWeight([_random(8, 32, 128, 32, torch.float32, False)]))


@pytest.mark.parametrize("group", [None, 32])
def test_quantize_int8_error_bound(group):
    w = torch.randn(64, 256)
    t = quantize_int8(w, group)
    err = (t.dequantize() - w).abs()
    bound = t.scales.float().repeat_interleave(t.group, dim=1) / 2
    assert bool((err <= bound + 1e-6).all())


@pytest.mark.parametrize("group", [32, 64, 128])
def test_quantize_int4_error_bound(group):
    w = torch.randn(64, 256)
    t = quantize_int4(w, group)
    err = (t.dequantize() - w).abs()
    bound = t.scales.float().repeat_interleave(group, dim=1) / 2
    assert bool((err <= bound + 1e-5).all())


def test_bad_layouts_rejected():
    with pytest.raises(ValueError, match="group"):
        QuantTensor(4, torch.zeros(4, 24, dtype=torch.uint8), torch.ones(4, 3), None, 16)
    with pytest.raises(ValueError, match="bits"):
        QuantTensor(2, torch.zeros(4, 32, dtype=torch.uint8), torch.ones(4, 1), None, 32)
    with pytest.raises(ValueError, match="48-byte"):
        QuantTensor(6, torch.zeros(4, 40, dtype=torch.uint8), torch.ones(4, 2), None, 16)
    with pytest.raises(ValueError, match="mins"):
        QuantTensor(6, torch.zeros(4, 48, dtype=torch.uint8), torch.ones(4, 4), torch.ones(4, 4), 16)


@needs_kernel
def test_kernel_rejects_bad_6_bit_layouts():
    x = torch.randn(1, 64)
    for cols, group, mins in ((40, 16, None), (48, 8, None), (48, 16, torch.ones(2, 4))):
        q = torch.zeros(2, cols, dtype=torch.uint8)
        s = torch.ones(2, max(1, 64 // group))
        with pytest.raises(RuntimeError, match="quant:"):
            torch.ops.iterserve_cpu.quant_linear(x, q, s, mins, None, None, 6, group, 8, 0)


@needs_kernel
@pytest.mark.parametrize("mode", ["auto", "float", "int8"])
def test_activation_kernel_chosen_at_load(monkeypatch, mode):
    from iterserve.model.linear import prepare_linears

    monkeypatch.setenv("ITERSERVE_QUANT_ACT", mode)
    layers = []
    for seed in range(3):
        m = Linear(512, 256, bias=False)
        set_quant(m, QuantWeight([_random(8, 256, 512, 32, torch.float32, False, seed=seed)]))
        layers.append(m)
    chosen = prepare_linears({"mlp.down_proj": layers}, cpp=True)
    on = chosen["quant_act_int8"]["mlp.down_proj"]
    if mode != "auto" or not cpu_ops.vnni_available():
        assert on == (mode == "int8" and cpu_ops.vnni_available())
    assert all(m.quant.act_int8 == on for m in layers)
    x = torch.randn(1, 512)
    want = F.linear(x, layers[0].quant.dequantize())
    tol = 2e-2 if on else 1e-4
    torch.testing.assert_close(layers[0](x), want, rtol=tol, atol=tol * float(want.abs().max()))


def test_bad_activation_mode_is_named(monkeypatch):
    from iterserve.model.quant.choose import quant_act_mode

    monkeypatch.setenv("ITERSERVE_QUANT_ACT", "fp8")
    with pytest.raises(ValueError, match="ITERSERVE_QUANT_ACT must be one of auto, float, int8"):
        quant_act_mode()


@needs_kernel
def test_few_row_threshold_chosen_by_timing():
    from iterserve.model.linear import QUANT_PROBE_ROWS, prepare_linears
    from iterserve.model.quant.choose import FEW_ROWS_UNBOUNDED

    layers = []
    for seed in range(3):
        m = Linear(512, 256, bias=False)
        set_quant(m, QuantWeight([_random(4, 256, 512, 32, torch.float16, False, seed=seed)]))
        layers.append(m)
    chosen = prepare_linears({"mlp.down_proj": layers}, cpp=True)
    rows = chosen["quant_few_rows"]["mlp.down_proj"]
    assert rows in (1, *QUANT_PROBE_ROWS, FEW_ROWS_UNBOUNDED)
    assert all(m.quant.few_rows == rows for m in layers)
    # Just past the threshold (the tiled path), or past every probe: the same result.
    x = torch.randn(max(QUANT_PROBE_ROWS) + 3 if rows == FEW_ROWS_UNBOUNDED else rows + 1, 512)
    want = F.linear(x, layers[0].quant.dequantize())
    torch.testing.assert_close(layers[0](x), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_narrow_scales_only_when_exact():
    from iterserve.model.quant.choose import narrow_scales

    g = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (8, 64), generator=g, dtype=torch.int8)
    exact = torch.rand(8, 2, generator=g).half().float()  # GGUF's float16 scales, widened
    t = QuantTensor(8, q, exact.clone(), None, 32)
    narrow_scales(t)
    assert t.scales.dtype == torch.float16 and torch.equal(t.scales.float(), exact)
    u = quantize_int8(torch.randn(8, 64, generator=g))  # float32 scales of its own
    narrow_scales(u)
    assert u.scales.dtype == torch.float32


def _per_row_q8(x: torch.Tensor) -> torch.Tensor:
    """x as W8A8 quantizes it: per row, scale amax / 127, round to nearest."""
    s = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0
    return torch.round(x / s).clamp(-127, 127) * s


@pytest.mark.parametrize("use_cpp", [False, True])
@pytest.mark.parametrize("rows", [9, 40, 300])
def test_int8_gemm_for_many_rows_of_a_w8a8_weight(use_cpp, rows):
    """Past ``few_rows`` a per-row int8 weight of a W8A8 scheme runs as one int8 GEMM on
    the input quantized per row: equal to F.linear of the quantized input and the
    dequantized weight (int32 sums are exact), within the input quantization's error of
    the float product."""
    if use_cpp and not cpu_ops.quant_available():
        pytest.skip("AVX-512 quantized kernels not built here")
    from iterserve.model.quant.packed import int_mm_ok

    t = _random(8, 200, 768, 768, torch.float32, False, seed=rows)
    assert int_mm_ok(t)
    w = QuantWeight([t], use_cpp=use_cpp, act_dynamic_int8=True)
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows))
    got = w.linear(x, None)
    exact = F.linear(_per_row_q8(x).double(), t.dequantize().double()).float()
    torch.testing.assert_close(got, exact, rtol=1e-4, atol=1e-4 * float(exact.abs().max()))
    want = F.linear(x.double(), t.dequantize().double()).float()
    assert float((got - want).abs().max()) < 0.03 * float(want.abs().max())
    # A weight-only scheme (W8A16) never quantizes its input.
    plain = QuantWeight([t], use_cpp=use_cpp).linear(x, None)
    torch.testing.assert_close(plain, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(17, 64, 48), (5, 80, 33), (70, 896, 1000)])
def test_int8_linear_kernel_equals_the_torch_chain(dtype, shape):
    """csrc/int8_gemm.cpp (quantize rows, _int_mm, scales + bias + cast in one pass) gives
    the torch chain's numbers bit for bit, in the input's dtype, with and without a bias,
    on row lengths and widths that are not multiples of 16."""
    if not cpu_ops.quant_available():
        pytest.skip("AVX-512 quantized kernels not built here")
    from iterserve.model.quant.packed import int_mm_torch, quantize_int8

    rows, inp, out = shape
    g = torch.Generator().manual_seed(rows)
    t = quantize_int8(torch.randn(out, inp, generator=g))
    x = (3 * torch.randn(rows, inp, generator=g)).to(dtype)
    x[1].zero_()  # an all-zero row: the scale's floor, not a division by zero
    for bias in (None, torch.randn(out, generator=g)):
        got = torch.ops.iterserve_cpu.int8_linear(x, t.qweight, t.scales, bias)
        want = int_mm_torch(x, t, bias)
        assert got.dtype == dtype
        assert torch.equal(got, want)
        assert not got[1].any() if bias is None else torch.equal(got[1], bias.to(dtype))


def test_int8_gemm_only_for_per_row_scales():
    from iterserve.model.quant.packed import int_mm_ok

    assert not int_mm_ok(_random(8, 64, 512, 32, torch.float16, False))  # Q8_0's groups
    assert not int_mm_ok(_random(8, 64, 512, 512, torch.float32, True))  # offsets
    assert not int_mm_ok(_random(4, 64, 512, 512, torch.float32, False))  # 4-bit


# The many-row int8 GEMM (kernel 2, csrc/quant_tile.h): every layout the int8 kernels
# take; 832 input features: 13 chunks of 64 (no multiple of a tile of 128 or 256 apart
# from the two-level layouts, which need whole 256-weight blocks, and groups of 64 and
# 128: 768), 203 outputs
# (not a multiple of the 4-column tile, two blocks for the 8-bit and the 6-bit layouts).
GEMM_LAYOUTS = [
    (8, 32, torch.float16, False),  # Q8_0
    (4, 32, torch.float16, False),  # Q4_0
    (4, 32, torch.uint8, True),  # Q4_K
    (6, 16, torch.int8, False),  # Q6_K
    (6, 64, torch.float16, False),
    (6, 32, torch.float32, False),  # Q5_0
    (8, 16, torch.float32, False),
    (8, 32, torch.float32, True),
    (4, 32, torch.float32, True),  # int4 at load, AWQ / GPTQ group 32
    (4, 128, torch.float32, True),  # AWQ / GPTQ group 128
    (4, 64, torch.float16, False),
    (8, 832, torch.float32, False),  # int8 per channel
]


def _gemm_case(layout, rows: int) -> tuple[QuantTensor, torch.Tensor]:
    bits, group, dtype, mins = layout
    inp = 768 if dtype in (torch.uint8, torch.int8) or group in (128, 64) else 832
    group = inp if group == 832 else group
    t = _random(bits, 203 if bits != 4 else 2203, inp, group, dtype, mins, seed=rows)
    x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(100 + rows))
    return t, x


# Layouts the lane GEMM takes (csrc/quant_lanes.h): groups of whole 32s (6 bits too).
LANE_LAYOUTS = [g for g in GEMM_LAYOUTS if g[1] % 32 == 0]


@needs_vnni
@pytest.mark.parametrize("layout", GEMM_LAYOUTS)
@pytest.mark.parametrize("rows", [1, 3, 8, 17, 64, 300])
def test_int8_gemm_equals_few_row_int8_kernel(layout, rows):
    """The GEMM computes what the few-row int8 kernel computes: bit for bit on the
    register tiles without mins (the same products, summed in the same order); within
    float32 rounding of the mins' share (summed 16 groups at a time) with them, and on
    the lane GEMM (the same integer dot per block, scaled and summed block by block)."""
    t, x = _gemm_case(layout, rows)
    got = _op(x, t, kernel=2)
    few = _op(x, t, few_rows=rows, kernel=1)
    if t.mins is None and layout not in LANE_LAYOUTS:
        assert torch.equal(got, few)
    else:
        torch.testing.assert_close(got, few, rtol=1e-5, atol=1e-5 * float(few.abs().max()))


def _group_values(t: QuantTensor, v: torch.Tensor, base: torch.Tensor | None) -> torch.Tensor:
    """Per-group scales (or mins) times their bases, as float32 products (the kernel's)."""
    f = v.float()
    if base is not None:
        f = f * base.float().repeat_interleave(256 // t.group, dim=1)
    return f.repeat_interleave(t.group // 32, dim=1)  # per 32-element block


def _lane_reference(x: torch.Tensor, t: QuantTensor) -> torch.Tensor:
    """The lane GEMM's numbers in torch: the input rounded per 32 as prep_lanes rounds
    it, each block's exact integer dot, then acc = fma(dot, s_w * s_x, acc) (and with
    mins acc = fma(-m_w, sum(x), acc)) block by block in float32 (an fma
    computed in float64 and rounded once gives the same)."""
    rows, inp = x.shape
    xb = x.view(rows, -1, 32)
    amax = xb.abs().amax(-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    xq = torch.round(xb * inv[..., None]).clamp(-127, 127).to(torch.int64)
    dx = amax / 127.0
    # The float sum over each block in _mm512_reduce_add_ps's order (halves, then quarters).
    h = xb[..., :16] + xb[..., 16:]
    h = h[..., 8:] + h[..., :8]
    h = h[..., 4:] + h[..., :4]
    xs = (h[..., 0] + h[..., 2]) + (h[..., 1] + h[..., 3])
    if t.bits == 8:
        wq = t.qweight.to(torch.int64)
    elif t.bits == 6:
        wq = unpack6(t.qweight).to(torch.int64) - 32
    else:
        b = t.qweight.view(t.out_features, -1, 16).to(torch.int64)
        wq = torch.cat((b & 15, b >> 4), dim=-1).reshape(t.out_features, -1)
        if t.mins is None:
            wq = wq - 8
    dots = torch.einsum("rbe,obe->rob", xq, wq.view(t.out_features, -1, 32))
    scale = _group_values(t, t.scales, t.scale_base)[None] * dx[:, None, :]
    mins = None if t.mins is None else _group_values(t, t.mins, t.min_base)
    acc = torch.zeros(rows, t.out_features, dtype=torch.float32)
    for blk in range(inp // 32):
        acc = (dots[..., blk].double() * scale[..., blk].double() + acc.double()).float()
        if mins is not None:
            acc = (acc.double() - mins[None, :, blk].double() * xs[:, None, blk].double()).float()
    return acc


@needs_vnni
@pytest.mark.parametrize("layout", LANE_LAYOUTS)
@pytest.mark.parametrize("out", [16, 203, 2203])
@pytest.mark.parametrize("rows", [1, 2, 12, 13, 40])
def test_lane_gemm_is_its_blockwise_sum(layout, out, rows):
    """The lane GEMM (16 output rows to a register, the rows past the last whole 16 one
    at a time) equals its definition: each block's exact integer dot, scaled by the two
    scales' float32 product and added in block order with one rounding."""
    bits, group, dtype, mins = layout
    inp = 768 if dtype in (torch.uint8, torch.int8) or group in (128, 64) else 832
    t = _random(bits, out, inp, inp if group == 832 else group, dtype, mins, seed=out + rows)
    x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(rows))
    assert torch.equal(_op(x, t, kernel=2), _lane_reference(x, t))


@needs_vnni
@pytest.mark.parametrize("layout", LANE_LAYOUTS)
def test_lane_gemm_rows_are_batch_invariant(layout):
    """A row's result does not depend on the rows beside it, their number (tiles of 12
    input rows and a remainder) or the threads splitting the output tiles."""
    t, x = _gemm_case(layout, 29)
    alone = torch.cat([_op(x[i:i + 1], t, kernel=2) for i in range(len(x))])
    assert torch.equal(_op(x, t, kernel=2), alone)
    assert torch.equal(_op(x[3:17], t, kernel=2), alone[3:17])
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(_op(x, t, kernel=2), alone)
    finally:
        torch.set_num_threads(threads)


@needs_vnni
@pytest.mark.parametrize("layout", GEMM_LAYOUTS)
@pytest.mark.parametrize("rows", [1, 3, 17, 300])
def test_int8_gemm_matches_dequantized_linear(layout, rows):
    """Against dequantize-then-F.linear: equal for the input as it quantizes it, within
    the int8 activations' error (about 0.4% of the output's scale) of the float input."""
    t, x = _gemm_case(layout, rows)
    got = _op(x, t, kernel=2)
    _assert_int8_activation_product(got, x, t)


@needs_vnni
def test_int8_gemm_rejects_layouts_it_cannot_take():
    t = _random(8, 16, 96, 32, torch.float32, False)  # 96: not whole 64-element chunks
    with pytest.raises(RuntimeError, match="int8-activation kernels need"):
        _op(torch.randn(20, 96), t, kernel=2)
    with pytest.raises(RuntimeError, match="kernel must be"):
        _op(torch.randn(20, 96), t, kernel=3)


@needs_kernel
@pytest.mark.parametrize("mode", ["auto", "float", "int8"])
def test_int8_gemm_rows_chosen_at_load(monkeypatch, mode):
    """``ITERSERVE_QUANT_ACT`` pins the int8 GEMM off (float) or on past the few-row
    kernels (int8); auto times it against the path chosen for many rows, from a probe
    range on or never; the layers then run the chosen kernel."""
    from iterserve.model.linear import prepare_linears
    from iterserve.model.quant.choose import GEMM_PROBE_ROWS
    from iterserve.model.quant.packed import FEW_ROWS_DEFAULT, GEMM_ROWS_NEVER

    monkeypatch.setenv("ITERSERVE_QUANT_ACT", mode)
    layers = []
    for seed in range(3):
        m = Linear(512, 256, bias=False)
        set_quant(m, QuantWeight([_random(4, 256, 512, 32, torch.float16, False, seed=seed)]))
        layers.append(m)
    chosen = prepare_linears({"mlp.down_proj": layers}, cpp=True)
    rows = chosen["quant_gemm_rows"]["mlp.down_proj"]
    if not cpu_ops.vnni_available() or mode == "float":
        assert rows == GEMM_ROWS_NEVER
    elif mode == "int8":
        assert rows == FEW_ROWS_DEFAULT + 1
    else:
        starts = (1, *GEMM_PROBE_ROWS[:-1])
        assert rows in (*(r + 1 for r in starts), GEMM_ROWS_NEVER)
    assert all(m.quant.gemm_rows == rows for m in layers)
    x = torch.randn(max(rows, GEMM_PROBE_ROWS[-1]) if rows != GEMM_ROWS_NEVER else 20, 512)
    q = layers[0].quant
    kernel = 2 if rows != GEMM_ROWS_NEVER else 0
    want = _op(x, q.parts[0], few_rows=q.few_rows, kernel=kernel)
    assert torch.equal(layers[0](x).detach(), want)
    if rows != GEMM_ROWS_NEVER:  # one row fewer than the threshold: not the GEMM
        x = x[: rows - 1]
        assert torch.equal(layers[0](x).detach(), _op(x, q.parts[0], few_rows=q.few_rows,
                                                      kernel=q.kernel(q.parts[0]) if len(x) <= 8 else 0))


@needs_vnni
@pytest.mark.parametrize("layout", [GEMM_LAYOUTS[0], GEMM_LAYOUTS[2]])
def test_int8_gemm_two_threads(layout):
    """Two threads split the output rows (each its own blocks and scales) and quantize
    the input rows in parallel: the result is the one thread's."""
    t, x = _gemm_case(layout, 45)
    one = _op(x, t, kernel=2)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        two = _op(x, t, kernel=2)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
