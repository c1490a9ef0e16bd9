"""Our C++ CPU kernels (model/csrc/) against torch's: the single-row GEMV
against F.linear, the single-token paged decode attention against SDPA over the
gathered context (and its cache write against a plain indexed store), the batched
paged decode and the AVX-512 prefill attention against SDPA over the gathered blocks."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from iterserve.model import cpu_ops

needs_kernels = pytest.mark.skipif(not cpu_ops.available(), reason="C++ CPU kernels not built here")


def test_kernels_build_where_they_can():
    """Where a compiler and AVX2/FMA exist, the kernels must build: the other tests here
    skip without them, and a broken build would otherwise pass unnoticed."""
    if os.environ.get("ITERSERVE_CPU_OPS") == "0" or not cpu_ops._cpu_supports_avx2_fma():
        pytest.skip("kernels disabled or CPU without AVX2/FMA")
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler")
    assert cpu_ops.available(), cpu_ops.unavailable_reason

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-5), torch.bfloat16: dict(atol=0.5, rtol=2e-2)}


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1024, 512), (37, 100), (512, 1408), (5, 7)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_linear(dtype, shape, with_bias):
    torch.manual_seed(0)
    out, inp = shape
    x, w = torch.randn(1, inp).to(dtype), torch.randn(out, inp).to(dtype)
    b = torch.randn(out).to(dtype) if with_bias else None
    got = torch.ops.iterserve_cpu.gemv(x, w, b)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.dtype == dtype and got.shape == (1, out)
    torch.testing.assert_close(got.float(), ref, **TOL[dtype])


@needs_kernels
def test_gemv_rejects_bad_shapes():
    with pytest.raises(RuntimeError, match="x must be"):
        torch.ops.iterserve_cpu.gemv(torch.randn(2, 8), torch.randn(4, 8), None)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.iterserve_cpu.gemv(torch.randn(1, 8), torch.randn(8, 4).t(), None)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "context_len"),
    [(8, 4, 64, 40), (4, 4, 32, 1), (6, 2, 24, 33), (8, 1, 128, 100)],
)
def test_decode_attention_matches_sdpa(dtype, heads, kv_heads, head_dim, context_len):
    torch.manual_seed(0)
    num_blocks, block_size = 12, 16
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim).to(dtype)
    nblk = -(-context_len // block_size)
    blocks = torch.randperm(num_blocks)[:nblk]
    pos = context_len - 1  # the new token's position
    slot = blocks[pos // block_size] * block_size + pos % block_size
    q = torch.randn(1, heads, head_dim).to(dtype)
    k, v = torch.randn(1, kv_heads, head_dim).to(dtype), torch.randn(1, kv_heads, head_dim).to(dtype)
    scale = head_dim**-0.5

    cache = kv.clone()
    got = torch.ops.iterserve_cpu.decode_attention(
        q, k, v, cache, blocks.view(1, -1), slot.view(1), context_len, scale
    )
    expect_cache = kv.clone()
    expect_cache[0].view(-1, kv_heads, head_dim)[slot] = k[0]
    expect_cache[1].view(-1, kv_heads, head_dim)[slot] = v[0]
    assert torch.equal(cache, expect_cache)

    keys = expect_cache[0][blocks].reshape(-1, kv_heads, head_dim)[:context_len].float()
    vals = expect_cache[1][blocks].reshape(-1, kv_heads, head_dim)[:context_len].float()
    group = heads // kv_heads
    keys = keys.repeat_interleave(group, 1).transpose(0, 1)  # [H, L, D]
    vals = vals.repeat_interleave(group, 1).transpose(0, 1)
    ref = F.scaled_dot_product_attention(q.float().transpose(0, 1), keys, vals, scale=scale)
    assert got.shape == (1, heads * head_dim) and got.dtype == dtype
    torch.testing.assert_close(got.float(), ref.transpose(0, 1).reshape(1, -1), **TOL[dtype])


@needs_kernels
@pytest.mark.parametrize("n", [1, 7, 8, 37, 32000])
def test_argmax_matches_torch(n):
    torch.manual_seed(0)
    x = torch.randn(5, n)
    if n > 1:
        x[1, n // 2] = x[1, -1] = 1e9  # a tie: the first index wins
        x[2, :] = -float("inf")  # all -inf: index 0
        x[3, n - 1] = float("nan")  # NaN counts as the maximum
        x[4, :] = 2.0
    assert torch.equal(torch.ops.iterserve_cpu.argmax(x), x.argmax(dim=-1))
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.iterserve_cpu.argmax(x.double())


def _paged_reference(q, kv, table, ctx, scale):
    """Each row attends over its own blocks: gathered, repeated for GQA, plain softmax."""
    heads, kvh, hd, bs = q.shape[1], kv.shape[3], kv.shape[4], kv.shape[2]
    out = []
    for i, c in enumerate(ctx):
        blocks = table[i, : -(-c // bs)]
        k = kv[0][blocks].reshape(-1, kvh, hd)[:c].float().repeat_interleave(heads // kvh, 1)
        v = kv[1][blocks].reshape(-1, kvh, hd)[:c].float().repeat_interleave(heads // kvh, 1)
        p = (torch.einsum("hd,lhd->hl", q[i].float(), k) * scale).softmax(-1)
        out.append(torch.einsum("hl,lhd->hd", p, v).reshape(-1))
    return torch.stack(out)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 4, 64), (14, 2, 64), (6, 2, 24)])
@pytest.mark.parametrize("rows", [1, 2, 3, 17])
def test_paged_decode_attention_matches_reference(dtype, heads, kv_heads, head_dim, rows):
    """Batched decodes over scattered blocks, rows of very different lengths (the team
    splits one row's context when there are fewer rows than threads), q a strided view
    as the fused qkv projection gives it."""
    g = torch.Generator().manual_seed(rows * 100 + heads)
    bs, num_blocks = 8, 120
    kv = torch.randn(2, num_blocks, bs, kv_heads, head_dim, generator=g).to(dtype)
    ctx = sorted(int(torch.randint(1, 300, (1,), generator=g)) for _ in range(rows))
    width = -(-max(ctx) // bs)
    table = torch.zeros(rows, width, dtype=torch.long)
    for i, c in enumerate(ctx):
        table[i, : -(-c // bs)] = torch.randperm(num_blocks, generator=g)[: -(-c // bs)]
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q = qkv[:, : heads * head_dim].view(rows, heads, head_dim)
    scale = head_dim**-0.5
    got = torch.ops.iterserve_cpu.paged_decode_attention(q, kv, table, torch.tensor(ctx), scale)
    assert got.shape == (rows, heads * head_dim) and got.dtype == dtype
    ref = _paged_reference(q, kv, table, ctx, scale)
    torch.testing.assert_close(got.float(), ref, **(TOL[dtype] if dtype == torch.bfloat16 else {}))


@needs_kernels
def test_paged_decode_attention_rejects_a_table_too_short():
    kv = torch.zeros(2, 4, 8, 2, 16)
    q = torch.zeros(1, 2, 16)
    with pytest.raises(RuntimeError, match="does not fit its block table"):
        torch.ops.iterserve_cpu.paged_decode_attention(
            q, kv, torch.zeros(1, 1, dtype=torch.long), torch.tensor([9]), 1.0)
    with pytest.raises(RuntimeError, match="block id out of range"):
        torch.ops.iterserve_cpu.paged_decode_attention(
            q, kv, torch.full((1, 1), 7, dtype=torch.long), torch.tensor([3]), 1.0)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 37, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_mkl_packed_linear_matches_linear(rows, with_bias):
    if not torch.ops.iterserve_cpu.mkl_pack_available():
        pytest.skip("this torch has no MKL")
    torch.manual_seed(rows)
    w, x = torch.randn(300, 200), torch.randn(rows, 200)
    b = torch.randn(300) if with_bias else None
    b_before = None if b is None else b.clone()
    packed = torch.ops.iterserve_cpu.mkl_pack_weight(w, 64)
    got = torch.ops.iterserve_cpu.mkl_packed_linear(x, packed, 300, b)
    torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    if b is not None:
        assert torch.equal(b, b_before)  # the bias is read, never written
    # A strided input (a view of a wider activation) multiplies the same.
    wide = torch.randn(rows, 400)
    torch.testing.assert_close(
        torch.ops.iterserve_cpu.mkl_packed_linear(wide[:, :200], packed, 300, None),
        F.linear(wide[:, :200], w), atol=1e-4, rtol=1e-5)


needs_prefill = pytest.mark.skipif(not cpu_ops.prefill_available(64),
                                   reason="C++ prefill attention not built here (no AVX-512)")


def test_prefill_kernel_builds_on_avx512():
    """On a CPU with AVX-512 the prefill kernel must build (its tests skip without it)."""
    if not cpu_ops.available() or not cpu_ops.cpu_flags() >= cpu_ops._AVX512_FLAGS:
        pytest.skip("C++ kernels unavailable or CPU without AVX-512")
    assert cpu_ops.prefill_available(64)
    assert not cpu_ops.prefill_available(24) and not cpu_ops.prefill_available(512)


def _prefill_reference(q, kv, table, starts, computed, scale):
    """Each chunk over its gathered blocks, as SDPA with an explicit causal mask."""
    bs, out = kv.shape[2], []
    for i, c in enumerate(computed):
        s, e = starts[i], starts[i + 1]
        n, ctx = e - s, c + e - s
        blocks = table[i, : -(-ctx // bs)]
        k, v = (kv[j][blocks].flatten(0, 1)[:ctx].float().transpose(0, 1)[None] for j in (0, 1))
        mask = torch.arange(ctx)[None, :] <= (c + torch.arange(n))[:, None]
        o = F.scaled_dot_product_attention(q[s:e].float().transpose(0, 1)[None], k, v, attn_mask=mask,
                                           scale=scale, enable_gqa=True)
        out.append(o[0].transpose(0, 1).reshape(n, -1))
    return torch.cat(out)


@needs_prefill
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 4, 64), (14, 2, 64), (4, 4, 128), (2, 1, 16)])
@pytest.mark.parametrize("chunks", [[(5, 0)], [(100, 0), (33, 70), (65, 200)], [(300, 17)], [(2, 0), (64, 64)]])
def test_prefill_attention_matches_reference(dtype, heads, kv_heads, head_dim, chunks):
    """Chunks (tokens, cached tokens) fresh and on cached prefixes, lengths off the
    32-query and 64-key tiles, over scattered blocks; q a strided view of a fused qkv."""
    g = torch.Generator().manual_seed(heads * 1000 + sum(n for n, _ in chunks))
    bs = 16
    nblk = [-(-(c + n) // bs) for n, c in chunks]
    kv = torch.randn(2, sum(nblk) + 3, bs, kv_heads, head_dim, generator=g).to(dtype)
    perm = torch.randperm(kv.shape[1], generator=g)
    table = torch.zeros(len(chunks), max(nblk), dtype=torch.long)
    for i, nb in enumerate(nblk):
        table[i, :nb] = perm[sum(nblk[:i]) : sum(nblk[:i]) + nb]
    tokens = sum(n for n, _ in chunks)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    starts = [0]
    for n, _ in chunks:
        starts.append(starts[-1] + n)
    computed = [c for _, c in chunks]
    scale = head_dim**-0.5
    got = torch.ops.iterserve_cpu.prefill_attention(
        q, kv, table, torch.tensor(starts), torch.tensor(computed), scale)
    assert got.shape == (tokens, heads * head_dim) and got.dtype == dtype
    ref = _prefill_reference(q, kv, table, starts, computed, scale)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.float(), ref, **tol)


@needs_prefill
def test_prefill_attention_rejects_bad_input():
    kv = torch.zeros(2, 4, 8, 2, 16)
    q = torch.zeros(9, 2, 16)
    one = torch.zeros(1, 2, dtype=torch.long)
    op = torch.ops.iterserve_cpu.prefill_attention
    with pytest.raises(RuntimeError, match="does not fit its block table"):
        op(q, kv, one, torch.tensor([0, 9]), torch.tensor([8]), 1.0)
    with pytest.raises(RuntimeError, match="block id out of range"):
        op(q, kv, torch.full((1, 2), 4, dtype=torch.long), torch.tensor([0, 9]), torch.tensor([0]), 1.0)
    with pytest.raises(RuntimeError, match="query_start must run from 0"):
        op(q, kv, one, torch.tensor([0, 8]), torch.tensor([0]), 1.0)
    with pytest.raises(RuntimeError, match="head_dim must be a multiple of 16"):
        op(torch.zeros(9, 2, 8), torch.zeros(2, 4, 8, 2, 8), one, torch.tensor([0, 9]), torch.tensor([0]), 1.0)


# The decoder's few-row projection kernels (csrc/few_rows.h): per row, AVX2 tiles, AVX-512
# tiles, and where the CPU has AVX512_BF16 the bf16 dot-product tiles and the packed layout.
FEW_ROWS_KERNELS = cpu_ops.few_rows_kernels()
BF16_DOT_KERNELS = {3, 4}


@needs_kernels
@pytest.mark.parametrize("kernel", FEW_ROWS_KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inp", [256, 100, 48, 33, 7, 1408])
@pytest.mark.parametrize("out", [37, 64])
def test_few_rows_linear_matches_linear(kernel, dtype, inp, out):
    """Rows 1..8 (tiles of 4 weight rows, a row tail when out is not a multiple of 4;
    in_features off the 8/16/32-element steps), with and without a bias."""
    torch.manual_seed(inp + out)
    w = torch.randn(out, inp).to(dtype)
    for rows in range(1, 9):
        x = torch.randn(rows, inp)
        b = torch.randn(out).to(dtype) if rows % 2 else None
        got = torch.ops.iterserve_cpu.few_rows_linear(x, w, b, kernel)
        # The bf16 dot-product kernels round the inputs to bf16 (as torch's bf16 linear
        # does); past that, weights and inputs are exact in float32: only the
        # summation order differs.
        xr = x.bfloat16().float() if kernel in BF16_DOT_KERNELS and dtype == torch.bfloat16 else x
        want = F.linear(xr, w.float(), None if b is None else b.float())
        assert got.shape == (rows, out) and got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=1e-4 * inp**0.5, rtol=1e-5)


@needs_kernels
def test_few_rows_kernels_agree_beyond_a_tile_of_inputs():
    """More inputs than one pass takes (up to 64) split into groups: every kernel the same."""
    w = torch.randn(70, 96)
    x = torch.randn(64, 96)
    want = F.linear(x, w)
    wb = w.bfloat16()
    want_bf16 = F.linear(x.bfloat16().float(), wb.float())
    for kernel in FEW_ROWS_KERNELS:
        for rows in (9, 13, 64):
            got = torch.ops.iterserve_cpu.few_rows_linear(x[:rows], w, None, kernel)
            torch.testing.assert_close(got, want[:rows], atol=1e-4, rtol=1e-5)
            if kernel in BF16_DOT_KERNELS:
                got = torch.ops.iterserve_cpu.few_rows_linear(x[:rows], wb, None, kernel)
                torch.testing.assert_close(got, want_bf16[:rows], atol=1e-4, rtol=1e-5)


@needs_kernels
def test_few_rows_kernel_setting():
    op = torch.ops.iterserve_cpu.set_few_rows_kernel
    best = op(-1)
    assert best == (2 if 2 in FEW_ROWS_KERNELS else 1)
    assert op(0) == best and op(best) == 0
    with pytest.raises(RuntimeError, match="does not exist"):
        op(5)
    if 3 not in FEW_ROWS_KERNELS:
        with pytest.raises(RuntimeError, match="does not exist"):
            op(3)
    with pytest.raises(RuntimeError, match=r"x must be \[1..64"):
        torch.ops.iterserve_cpu.few_rows_linear(torch.zeros(65, 8), torch.zeros(4, 8), None)


needs_skinny = pytest.mark.skipif(not cpu_ops.skinny_available(),
                                  reason="C++ few-row kernel not built here (no AVX-512)")


@needs_skinny
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "out", "inp"), [(1, 7, 16), (2, 2816, 512), (3, 33, 160), (4, 512, 1408),
                                                  (9, 64, 48), (16, 100, 32)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_skinny_linear_matches_linear(dtype, rows, out, inp, with_bias):
    w = torch.randn(out, inp).to(dtype)
    b = torch.randn(out).to(dtype) if with_bias else None
    x = torch.randn(rows, inp).to(dtype)
    got = torch.ops.iterserve_cpu.skinny_linear(x, w, b)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.shape == (rows, out) and got.dtype == dtype
    tol = dict(atol=2e-2 * float(want.abs().max()), rtol=1e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(got.float(), want, **tol)


@needs_skinny
def test_skinny_linear_rejects_bad_shapes():
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.iterserve_cpu.skinny_linear(torch.zeros(2, 8), torch.zeros(4, 8), None)
    with pytest.raises(RuntimeError, match="disagree on in_features"):
        torch.ops.iterserve_cpu.skinny_linear(torch.zeros(2, 16), torch.zeros(4, 32), None)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.iterserve_cpu.skinny_linear(torch.zeros(2, 16), torch.zeros(16, 4).t(), None)
