"""The 8-bit KV cache (``--kv-cache-dtype int8 | fp8``): per-row quantization, the C++
kernels against the torch reference on the dequantized cache, sizing, and the config."""

from __future__ import annotations

import pytest
import torch

from iterserve.config import KV_SCALE_BYTES, CacheConfig, kv_row_bytes
from iterserve.model import cpu_ops
from iterserve.model.attention import Attention, forward_context
from iterserve.model.kv_quant import cache_dtype_for, dequantize_rows, quantize_rows
from tests.model import test_attention_window as window_tests
from tests.model.test_cpu_ops import _paged_reference, _prefill_reference

DTYPES_8BIT = [torch.int8, torch.float8_e4m3fn]
needs_kernels = pytest.mark.skipif(not cpu_ops.available(), reason="C++ kernels unavailable")
needs_prefill = pytest.mark.skipif(not cpu_ops.prefill_available(64),
                                   reason="C++ prefill attention not built here (no AVX-512)")


def _quantized_cache(shape, dtype, g, magnitude=1.0):
    """A random [2, blocks, bs, kvh, hd] cache in 8 bits, its scales, and its dequantized
    float32 copy; row magnitudes differ by 100x (each row keeps its own scale)."""
    x = torch.randn(shape, generator=g) * magnitude
    x *= torch.logspace(-1, 1, shape[3])[None, None, None, :, None]
    q, s = quantize_rows(x, dtype)
    return q, s, dequantize_rows(q, s, torch.float32), x


@pytest.mark.parametrize("dtype", DTYPES_8BIT)
def test_quantize_rows_round_trip(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 4, 64, generator=g) * torch.logspace(-3, 3, 4)[None, :, None]
    x[3, 1] = 0.0  # a row of zeros stays zeros
    q, s = quantize_rows(x, dtype)
    assert q.dtype == dtype and s.dtype == torch.bfloat16 and s.shape == (50, 4)
    back = dequantize_rows(q, s, torch.float32)
    assert torch.equal(back[3, 1], torch.zeros(64))
    # Relative to each row's largest value: int8 within half a step (1/254), e4m3
    # within half an ulp of its 3-bit mantissa (1/16 of the value).
    amax = x.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    if dtype == torch.int8:
        assert ((back - x).abs() / amax).max() <= 1 / 254 + 1e-3
    else:
        assert ((back - x).abs() <= x.abs() / 16 + amax * 2**-9 / 448 + 1e-30).all()


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES_8BIT)
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 4, 64), (6, 2, 24)])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_paged_decode_8bit_matches_reference_on_dequantized(dtype, qdtype, heads, kv_heads, head_dim, rows):
    g = torch.Generator().manual_seed(rows * 7 + heads)
    bs, num_blocks = 8, 80
    kv, scales, deq, _ = _quantized_cache((2, num_blocks, bs, kv_heads, head_dim), dtype, g)
    ctx = sorted(int(torch.randint(1, 200, (1,), generator=g)) for _ in range(rows))
    table = torch.zeros(rows, -(-max(ctx) // bs), dtype=torch.long)
    for i, c in enumerate(ctx):
        table[i, : -(-c // bs)] = torch.randperm(num_blocks, generator=g)[: -(-c // bs)]
    q = torch.randn(rows, heads, head_dim, generator=g).to(qdtype)
    scale = head_dim**-0.5
    got = torch.ops.iterserve_cpu.paged_decode_attention(
        q, kv, table, torch.tensor(ctx), scale, 0, 0.0, scales)
    assert got.dtype == qdtype
    ref = _paged_reference(q, deq, table, ctx, scale)
    tol = dict(atol=2e-2, rtol=2e-2) if qdtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.float(), ref, **tol)


@needs_kernels
def test_paged_decode_8bit_needs_its_scales():
    kv = torch.zeros(2, 4, 8, 2, 16, dtype=torch.int8)
    q = torch.zeros(1, 2, 16)
    with pytest.raises(RuntimeError, match="kv_scales"):
        torch.ops.iterserve_cpu.paged_decode_attention(
            q, kv, torch.zeros(1, 1, dtype=torch.long), torch.tensor([3]), 1.0)
    with pytest.raises(RuntimeError, match="kv_scales"):
        torch.ops.iterserve_cpu.paged_decode_attention(
            q, kv, torch.zeros(1, 1, dtype=torch.long), torch.tensor([3]), 1.0, 0, 0.0,
            torch.zeros(2, 4, 8, 2))  # float32 scales


@needs_prefill
@pytest.mark.parametrize("dtype", DTYPES_8BIT)
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 4, 64), (2, 1, 16)])
@pytest.mark.parametrize("chunks", [[(5, 0)], [(100, 0), (33, 70)], [(2, 0), (64, 64)]])
def test_prefill_8bit_matches_reference_on_dequantized(dtype, qdtype, heads, kv_heads, head_dim, chunks):
    g = torch.Generator().manual_seed(heads * 1000 + sum(n for n, _ in chunks))
    bs = 16
    nblk = [-(-(c + n) // bs) for n, c in chunks]
    kv, scales, deq, _ = _quantized_cache((2, sum(nblk) + 3, bs, kv_heads, head_dim), dtype, g)
    perm = torch.randperm(kv.shape[1], generator=g)
    table = torch.zeros(len(chunks), max(nblk), dtype=torch.long)
    for i, nb in enumerate(nblk):
        table[i, :nb] = perm[sum(nblk[:i]) : sum(nblk[:i]) + nb]
    tokens = sum(n for n, _ in chunks)
    q = torch.randn(tokens, heads, head_dim, generator=g).to(qdtype)
    starts = [0]
    for n, _ in chunks:
        starts.append(starts[-1] + n)
    computed = [c for _, c in chunks]
    scale = head_dim**-0.5
    got = torch.ops.iterserve_cpu.prefill_attention(
        q, kv, table, torch.tensor(starts), torch.tensor(computed), scale, 0, 0.0, scales)
    assert got.dtype == qdtype
    ref = _prefill_reference(q, deq, table, starts, computed, scale)
    tol = dict(atol=2e-2, rtol=2e-2) if qdtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.float(), ref, **tol)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES_8BIT)
def test_8bit_attention_close_to_float(dtype):
    """The accuracy cost at the kernel: attention over an 8-bit cache against the same
    float32 cache. Documented (docs/quantization.md): int8 0.8%, e4m3 3.5% of the
    output's scale on unit-normal K/V; the bounds are twice that."""
    g = torch.Generator().manual_seed(5)
    bs, num_blocks, heads, kvh, hd = 16, 40, 8, 2, 64
    kv, scales, _, x = _quantized_cache((2, num_blocks, bs, kvh, hd), dtype, g)
    x = x / torch.logspace(-1, 1, kvh)[None, None, None, :, None]  # unit-normal rows again
    kv, scales = quantize_rows(x, dtype)
    ctx = [37, 300, 600]
    table = torch.stack([torch.randperm(num_blocks, generator=g)[:38] for _ in ctx])
    q = torch.randn(len(ctx), heads, hd, generator=g)
    got = torch.ops.iterserve_cpu.paged_decode_attention(
        q, kv, table, torch.tensor(ctx), hd**-0.5, 0, 0.0, scales)
    ref = _paged_reference(q, x, table, ctx, hd**-0.5)
    err = (got - ref).abs().max() / ref.abs().max()
    assert err < (1.5e-2 if dtype == torch.int8 else 7e-2), float(err)


def test_kv_row_bytes_and_cache_dtype():
    assert kv_row_bytes(64, 2) == 128 and kv_row_bytes(64, 4) == 256
    assert kv_row_bytes(64, 4, "int8") == kv_row_bytes(64, 2, "fp8") == 64 + KV_SCALE_BYTES
    assert cache_dtype_for("auto", torch.bfloat16) == torch.bfloat16
    assert cache_dtype_for("int8", torch.float32) == torch.int8
    assert cache_dtype_for("fp8_e4m3", torch.float32) == torch.float8_e4m3fn
    with pytest.raises(ValueError, match=r"kv_cache_dtype.*'int4'"):
        CacheConfig(cache_dtype="int4")
    with pytest.raises(ValueError, match=r"kv_cache_dtype.*'fp8_e5m2'"):
        kv_row_bytes(64, 2, "fp8_e5m2")


@pytest.mark.parametrize("dtype", DTYPES_8BIT)
@pytest.mark.parametrize(("view", "case"), [("paged", "mixed"), ("grouped", "mixed"), ("lone", "lone")])
@pytest.mark.parametrize(("window", "cap"), [(None, None), (5, None), (7, 3.0)])
def test_attention_layer_over_8bit_cache(dtype, view, case, window, cap):
    """A layer's step over an 8-bit cache, every view (C++ kernels and the torch paths,
    sliding window and soft-capping included): the step's K/V are written quantized, and
    the output equals the dense reference over the dequantized cache (on the torch path,
    a chunk attends to its own K/V as computed, before quantization, except where the
    window or the cap sends a chunk on a prefix through ``attention_window``)."""
    BS, HD, HEADS, KV_HEADS = window_tests.BS, window_tests.HD, window_tests.HEADS, window_tests.KV_HEADS
    if view != "grouped" and not cpu_ops.prefill_available(HD):
        pytest.skip("C++ kernels not built here")
    torch.manual_seed(0)
    contexts, news = window_tests.CASES[case]
    layer = Attention(0, HEADS, KV_HEADS, HD, 0.3, sliding_window=window, logit_softcap=cap)
    layer.cpu_decode = view == "lone"
    layer.kv_cache, layer.kv_scales = quantize_rows(
        torch.randn(2, window_tests.NUM_BLOCKS, BS, KV_HEADS, HD), dtype)
    meta, tables = window_tests.make_step(contexts, news, "grouped" if view == "lone" else view)
    t = sum(news)
    q, k, v = (torch.randn(t, h, HD) for h in (HEADS, KV_HEADS, KV_HEADS))
    with forward_context(meta):
        out = layer.attend(q, k, v).view(t, HEADS, HD)
    deq = dequantize_rows(layer.kv_cache, layer.kv_scales, torch.float32)
    # The step wrote its K/V quantized, each row within its 8-bit step of the value.
    written = deq.flatten(1, 2)[:, meta.slot_mapping]
    err = (written - torch.stack([k, v])).abs().max() / torch.stack([k, v]).abs().max()
    assert 0 < err < (1 / 200 if dtype == torch.int8 else 1 / 12)
    row = 0
    for ctx, n, table in zip(contexts, news, tables):
        keys, values = deq[:, table].flatten(1, 2)[:, :ctx]
        if view == "grouped" and n > 1 and (n == ctx or not (window or cap)):
            keys = torch.cat([keys[: ctx - n], k[row : row + n]])
            values = torch.cat([values[: ctx - n], v[row : row + n]])
        ref = window_tests.reference(q[row : row + n], keys, values, window, cap, 0.3)
        torch.testing.assert_close(out[row : row + n], ref, atol=1e-4, rtol=1e-4)
        row += n
