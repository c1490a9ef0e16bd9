"""The CPU projection kernels (model/linear.py) compute what F.linear computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from iterserve.model.linear import Linear, prepare_linears, set_gemv_mode, split_gemv


@pytest.mark.parametrize("row_slices", [True, False])
@pytest.mark.parametrize("slices", [1, 2, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_split_gemv_matches_linear(row_slices, slices, bias):
    torch.manual_seed(0)
    layer = Linear(96, 40, bias=bias)
    x = torch.randn(1, 96)
    assert set_gemv_mode(layer, "rows" if row_slices else "cols", slices)
    got = split_gemv(x, layer.gemv_weight, row_slices, layer.bias)
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
        # More rows never take the sliced path.
        x3 = torch.randn(3, 96)
        torch.testing.assert_close(layer(x3), F.linear(x3, layer.weight, layer.bias))


def test_uneven_split_stays_plain():
    layer = Linear(8, 10)
    assert not set_gemv_mode(layer, "rows", 4)
    assert layer.gemv_weight is None and layer.gemv_mode == "plain"
    with pytest.raises(ValueError, match="gemv mode"):
        set_gemv_mode(layer, "diagonal", 2)


@pytest.mark.parametrize("mode", ["rows", "cols"])
def test_prepare_linears_forced_mode(mode):
    torch.manual_seed(0)
    layers = [Linear(64, 128), Linear(64, 128)]
    ref = [(m.weight.detach().clone(), m.bias.detach().clone()) for m in layers]
    chosen = prepare_linears({"proj": layers}, gemv=mode)
    assert chosen["gemv"] == {"proj": mode}
    x = torch.randn(1, 64)
    with torch.inference_mode():
        for m, (w, b) in zip(layers, ref):
            assert m.gemv_mode == mode
            torch.testing.assert_close(m(x), F.linear(x, w, b))
            torch.testing.assert_close(m(x.repeat(5, 1)), F.linear(x.repeat(5, 1), w, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["mkl", "onednn"])
def test_packed_kernels_match_linear(dtype, kind):
    """Each multi-row kernel prepare_linears times computes F.linear (in float32 for a
    bfloat16 weight on MKL's float32 copy; one bf16 rounding of the output)."""
    from iterserve.model import linear

    torch.manual_seed(0)
    layer = Linear(96, 40, bias=True).to(dtype)
    if kind not in linear._multirow_kinds([layer], cpp=True):
        pytest.skip(f"{kind} cannot run here")
    linear._pack(layer, kind)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    with torch.inference_mode():
        for rows in (2, 37, 300):
            x = torch.randn(rows, 96).to(dtype)
            want = F.linear(x.float(), layer.weight.float(), layer.bias.float())
            torch.testing.assert_close(layer(x).float(), want, rtol=tol, atol=tol)


def test_timing_picks_a_kernel_that_runs():
    """prepare_linears packs for whichever kernel times fastest, or none."""
    torch.manual_seed(0)
    layers = [Linear(256, 512), Linear(256, 512)]
    chosen = prepare_linears({"proj": layers}, cpp=True)
    assert chosen["packed"] in (False, "mkl", "onednn")
    for m in layers:
        assert (m.packed_weight is not None) == bool(chosen["packed"])
