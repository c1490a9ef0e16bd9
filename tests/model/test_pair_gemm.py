"""The pair-packed bfloat16 GEMM (csrc/pair_gemm.cpp) against a float32 matmul of the
same bfloat16 operands rounded once, and the projections' choice of it at load
(model/linear.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from iterserve.model import cpu_ops
from iterserve.model.linear import (
    PAIR_PROBE_ROWS,
    Linear,
    _choose_pair,
    pack_pairs,
    prepare_linears,
)

pytestmark = pytest.mark.skipif(not cpu_ops.pair_available(),
                                reason="the AVX-512 pair GEMM is not built on this CPU")
HAS_BF16 = "avx512_bf16" in cpu_ops.cpu_flags()


def test_pack_pairs_layout():
    w = torch.randn(48, 64).bfloat16()
    p = pack_pairs(w)
    assert p.shape == (3, 32, 16, 2)
    # Column c's inputs 2j, 2j + 1 sit side by side in block c // 16.
    assert torch.equal(p[2, 5, 7], w[2 * 16 + 7, 10:12])
    stacked = torch.randn(2, 32, 16).bfloat16()
    assert torch.equal(pack_pairs(stacked)[1], pack_pairs(stacked[1]))


@pytest.mark.parametrize("dot", [False, True] if HAS_BF16 else [False])
@pytest.mark.parametrize(("rows", "out", "inp"), [(0, 32, 16), (1, 32, 16), (5, 64, 48), (12, 96, 1024),
                                                  (13, 3072, 1024), (40, 160, 2048)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_pair_linear_matches_linear(rows, out, inp, with_bias, dot):
    g = torch.Generator().manual_seed(rows * 7 + out)
    w = torch.randn(out, inp, generator=g).bfloat16()
    b = torch.randn(out, generator=g).bfloat16() if with_bias else None
    x = torch.randn(rows, inp, generator=g).bfloat16()
    got = torch.ops.iterserve_cpu.pair_linear(x, pack_pairs(w), b, dot)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.shape == (rows, out) and got.dtype == torch.bfloat16
    if not rows:
        return
    # float32 sums in another order, rounded once: within one bfloat16 step of the
    # value (or of the row's scale, where the sum cancels).
    diff = (got.float() - want).abs()
    step = want.abs() * 2.0**-7 + float(want.abs().max()) * 2.0**-10
    assert bool((diff <= step).all()), float((diff / step).max())
    assert float((got == want.bfloat16()).float().mean()) >= 0.95


def test_pair_linear_rejects_bad_input():
    w = pack_pairs(torch.randn(32, 16).bfloat16())
    with pytest.raises(RuntimeError, match="bf16"):
        torch.ops.iterserve_cpu.pair_linear(torch.zeros(2, 16), w, None)
    with pytest.raises(RuntimeError, match="disagree"):
        torch.ops.iterserve_cpu.pair_linear(torch.zeros(2, 18).bfloat16(), w, None)
    with pytest.raises(RuntimeError, match="pair-packed"):
        torch.ops.iterserve_cpu.pair_linear(torch.zeros(2, 16).bfloat16(), torch.zeros(32, 16).bfloat16(), None)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.iterserve_cpu.pair_linear(torch.zeros(2, 16).bfloat16(),
                                            pack_pairs(torch.randn(48, 16).bfloat16()), None)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.iterserve_cpu.pair_linear(torch.zeros(2, 16).bfloat16(), w, torch.zeros(31))


def _layer(out: int, inp: int, dtype: torch.dtype, bias: bool = False) -> Linear:
    m = Linear(inp, out, bias=bias).to(dtype)
    with torch.no_grad():
        m.weight.normal_(0, inp**-0.5)
    return m


def test_a_layer_takes_the_pair_gemm_up_to_its_rows():
    m = _layer(64, 32, torch.bfloat16, bias=True)
    m.pair_weight, m.pair_rows = pack_pairs(m.weight.detach()), 8
    x = torch.randn(9, 32).bfloat16()
    with torch.inference_mode():
        assert torch.equal(m(x[:8]), torch.ops.iterserve_cpu.pair_linear(x[:8], m.pair_weight, m.bias))
        # Above pair_rows: the layer's other kernels (here torch's own bf16 linear).
        assert torch.equal(m(x), F.linear(x, m.weight, m.bias))


def test_choose_pair_keeps_a_copy_only_when_chosen():
    group = [_layer(64, 32, torch.bfloat16) for _ in range(2)]
    rows = _choose_pair(group, skinny_rows=4, rounds=1)
    assert rows in (0, *PAIR_PROBE_ROWS)
    for m in group:
        assert (m.pair_weight is not None) == bool(rows) and m.pair_rows == rows
    # float32 layers and widths the kernel does not take are never timed.
    assert _choose_pair([_layer(64, 32, torch.float32)], skinny_rows=0) == 0
    assert _choose_pair([_layer(48, 32, torch.bfloat16)], skinny_rows=0) == 0


def test_prepare_linears_reports_the_pair_rows():
    group = [_layer(96, 64, torch.bfloat16) for _ in range(2)]
    chosen = prepare_linears({"proj": group}, cpp=True)
    assert chosen["pair_rows"]["proj"] in (0, *PAIR_PROBE_ROWS)
    x = torch.randn(6, 64).bfloat16()
    with torch.inference_mode():
        want = F.linear(x.float(), group[0].weight.float())
        got = group[0](x)
    torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0.02)
