"""One MoE block's time per step: the engine's path (``layers/moe.py``: one GEMM pair
per active expert over its sorted token slice, a Python loop over the active experts),
plain (F.linear on the stacked weights) and prepared (each expert a ``Linear`` whose
kernels ``prepare_linears`` chose, as the engine loads them), against one
``torch._grouped_mm`` call per projection over all of them (no loop, no host sync; what
transformers 5 runs), and against the C++ kernel the engine takes for bfloat16 blocks
on AVX-512 CPUs (``csrc/moe_experts.cpp``: the whole block in one call over weights
packed at load). It answers which path each step size should take.

Shapes: Qwen3-30B-A3B's block (hidden 2048, 128 experts of 768, top-8) and the
benchmark MoE model's (``bench_models.py`` qwen3-moe-1b: hidden 1024, 32 experts of
384, top-4), at step sizes from a lone decode to a prefill chunk. Both paths are checked
equal before they are timed. ``--tiny`` runs toy shapes (a smoke run; no meaningful
numbers).

    python benchmarks/bench_moe_layer.py [--dtypes fp32,bf16] [--threads 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))

from common import MachineMonitor, machine_description
from iterserve.model import cpu_ops
from iterserve.model.layers.moe import (
    FusedMoE,
    combine,
    fused_experts,
    pack_experts,
    route,
    sort_by_expert,
)
from iterserve.model.linear import prepare_linears

# name -> (hidden, experts, intermediate, top-k)
SHAPES = {
    "qwen3-30b-a3b": (2048, 128, 768, 8),
    "qwen3-moe-1b": (1024, 32, 384, 4),
}
TINY = {"tiny": (64, 16, 32, 4)}
TOKENS = (1, 4, 16, 64, 256, 1024)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def grouped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """``fused_experts`` with every expert's GEMM in one grouped call per projection."""
    inter = w13.shape[1] // 2
    order, token_of, counts = sort_by_expert(topk_ids, w13.shape[0])
    offs = counts.cumsum(0).to(torch.int32)
    xs = x.index_select(0, token_of)
    gate, up = torch._grouped_mm(xs, w13.transpose(-2, -1), offs=offs).split(inter, dim=-1)
    ys = torch._grouped_mm(F.silu(gate).mul_(up), w2.transpose(-2, -1), offs=offs)
    return combine(ys, topk_weights, order, token_of, x.dtype)


def prepared(w13: torch.Tensor, w2: torch.Tensor, top_k: int) -> tuple:
    """The experts as the engine runs them: ``Linear`` views laid out by prepare_linears."""
    e, inter2, h = w13.shape
    moe = FusedMoE(h, inter2 // 2, e, top_k, renormalize=True, float32_weights=False)
    moe.w13.data, moe.w2.data = w13, w2
    lin13, lin2 = moe.expert_linears()
    prepare_linears({"w13": lin13, "w2": lin2}, cpp=cpu_ops.available())
    return lin13, lin2


def best_time(fn, min_seconds: float) -> float:
    fn()
    best, spent = float("inf"), 0.0
    while spent < min_seconds:
        t = time.perf_counter()
        fn()
        dt = time.perf_counter() - t
        best, spent = min(best, dt), spent + dt
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=0.5, help="per measurement")
    ap.add_argument("--tiny", action="store_true", help="toy shapes, for a smoke run")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"# MoE block per step — {machine_description()}, {args.threads} threads, "
          f"torch {torch.__version__}")
    print("| shape | dtype | tokens | active experts | plain loop ms | prepared loop ms | "
          "grouped ms | C++ kernel ms | prepared / plain | grouped / prepared | "
          "prepared / C++ |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    with MachineMonitor() as monitor, torch.inference_mode():
        for name, (h, e, inter, k) in (TINY if args.tiny else SHAPES).items():
            for dname in args.dtypes.split(","):
                dtype = DTYPES[dname]
                w13 = (torch.randn(e, 2 * inter, h, generator=g) * 0.02).to(dtype)
                w2 = (torch.randn(e, h, inter, generator=g) * 0.02).to(dtype)
                router = torch.randn(e, h, generator=g).to(dtype)
                linears = prepared(w13, w2, k)
                kernel = dtype == torch.bfloat16 and cpu_ops.moe_available()
                packed = (pack_experts(w13), pack_experts(w2)) if kernel else None
                for n in TOKENS[:3] if args.tiny else TOKENS:
                    x = torch.randn(n, h, generator=g).to(dtype)
                    weights, ids = route(F.linear(x, router), k, True, dtype)
                    want = fused_experts(x, w13, w2, weights, ids)
                    got = grouped_experts(x, w13, w2, weights, ids)
                    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3)
                    step = (x, w13, w2, weights, ids)
                    torch.testing.assert_close(fused_experts(*step, linears), want,
                                               rtol=1e-2, atol=1e-3)
                    loop = best_time(partial(fused_experts, *step), args.seconds)
                    prep = best_time(partial(fused_experts, *step, linears), args.seconds)
                    grouped = best_time(partial(grouped_experts, *step), args.seconds)
                    cpp, cpp_ms, ratio = float("nan"), "-", "-"
                    if packed is not None:
                        op = partial(torch.ops.iterserve_cpu.moe_experts, x, *packed,
                                     weights, ids)
                        # Equal but for float32 summation order: within a bfloat16
                        # step of each value, or of the block's scale where experts cancel.
                        diff = (op().float() - want.float()).abs()
                        bound = want.float().abs() * 2**-7 + want.float().abs().max() * 2**-8
                        assert bool((diff <= bound).all()), float((diff / bound).max())
                        cpp = best_time(op, args.seconds)
                        cpp_ms, ratio = f"{cpp * 1e3:.3f}", f"{prep / cpp:.2f}"
                    print(f"| {name} | {dname} | {n} | {int(ids.unique().numel())} | "
                          f"{loop * 1e3:.3f} | {prep * 1e3:.3f} | {grouped * 1e3:.3f} | "
                          f"{cpp_ms} | {prep / loop:.2f} | {grouped / prep:.2f} | {ratio} |")
    print(f"# {monitor.report}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
