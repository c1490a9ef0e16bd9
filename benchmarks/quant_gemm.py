"""One quantized projection's time at many rows, on each kernel ``quant_linear`` has
(csrc/quant_gemm.cpp): the few-row float-activation kernel (every weight row streamed
once for all rows), dequantized tiles and at::mm, the few-row int8-activation kernel
(VNNI, 4 rows at a time over the whole weight), and the int8 GEMM (quant_lanes.h for Q8_0 /
Q4_0: 16 output rows to a register; quant_tile.h for the others:
register tiles over blocks of weight rows kept in L2). It answers whether the int8 GEMM
is in the range of a real GEMM (GFLOP/s, 2 per multiply-add) and by how much it beats
the kernels it replaces at prefill chunks and decode batches of 16-256 rows.

Weights are random in each packed layout (Q8_0, Q4_0, Q4_K, Q6_K) at the projection
shapes of the benchmark models (Llama-56M, Qwen2-0.5B); every kernel's result is
checked against the dequantized weight's F.linear before it is timed. Kernels take
turns (one call each per round), best of ``--repeats`` rounds, so a busy machine moves
all of them alike; only large ratios mean anything on one. ``--tiny`` is a smoke run.

    python benchmarks/quant_gemm.py [--threads 2] [--rows 16,64,256,1024]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from common import MachineMonitor, machine_description
from iterserve.model import cpu_ops
from iterserve.model.quant.packed import QuantTensor, pack4, pack6, vnni_layout_ok

# name -> (out_features, in_features)
SHAPES = {
    "llama-56m qkv": (1024, 512),
    "llama-56m gate_up": (2816, 512),
    "llama-56m down": (512, 1408),
    "qwen2-0.5b gate_up": (9728, 896),
    "qwen2-0.5b down": (896, 4864),
}
TINY = {"tiny": (136, 256)}
# name -> (bits, group, scale dtype, mins): as the GGUF loader packs them
LAYOUTS = {
    "Q8_0": (8, 32, torch.float16, False),
    "Q4_0": (4, 32, torch.float16, False),
    "Q4_K": (4, 32, torch.uint8, True),
    "Q6_K": (6, 16, torch.int8, False),
}
# kernel name -> (max_few_rows, kernel argument of quant_linear)
KERNELS = {
    "float few-row": (1 << 30, 0),
    "dequant tiles": (0, 0),
    "int8 few-row": (1 << 30, 1),
    "int8 GEMM": (0, 2),
}


def random_tensor(layout: tuple, out: int, inp: int) -> QuantTensor:
    bits, group, dtype, mins = layout
    g = torch.Generator().manual_seed(0)
    if bits == 8:
        q = torch.randint(-128, 128, (out, inp), generator=g, dtype=torch.int8)
    elif bits == 6:
        q = pack6(torch.randint(0, 64, (out, inp), generator=g, dtype=torch.uint8))
    else:
        q = pack4(torch.randint(0, 16, (out, inp), generator=g, dtype=torch.uint8))
    if dtype in (torch.uint8, torch.int8):  # two-level, as the K-quants
        lo = 1 if dtype == torch.uint8 else -127
        s = torch.randint(lo, 64, (out, inp // group), generator=g, dtype=dtype)
        m = torch.randint(0, 64, (out, inp // group), generator=g, dtype=dtype) if mins else None
        bd = torch.float16 if bits == 6 else torch.float32
        sb = (torch.rand(out, inp // 256, generator=g) * 1e-3).to(bd)
        mb = (torch.rand(out, inp // 256, generator=g) * 1e-3).to(bd) if mins else None
        return QuantTensor(bits, q, s, m, group, sb, mb)
    s = (torch.rand(out, inp // group, generator=g) * 0.02 + 0.001).to(dtype)
    return QuantTensor(bits, q, s, None, group)


def call(t: QuantTensor, x: torch.Tensor, few: int, kernel: int) -> torch.Tensor:
    return torch.ops.iterserve_cpu.quant_linear(x, t.qweight, t.scales, t.mins, t.scale_base,
                                                t.min_base, t.bits, t.group, few, kernel)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="16,64,256,1024")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--tiny", action="store_true", help="toy shape, for a smoke run")
    args = ap.parse_args(argv)
    if not cpu_ops.quant_available():
        print("the AVX-512 quantized kernels are not available here", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    kernels = dict(KERNELS)
    if not cpu_ops.vnni_available():
        kernels = {k: v for k, v in kernels.items() if v[1] == 0}
    names = list(kernels)
    print(f"# quantized projection, ms (GFLOP/s) — {machine_description()}, "
          f"{args.threads} threads, best of {args.repeats} interleaved")
    print(f"| shape | layout | rows | {' | '.join(names)} | GEMM / best other |")
    print(f"|---|---|---:|{'---:|' * len(names)}---:|")
    rows_list = [4, 16] if args.tiny else [int(r) for r in args.rows.split(",")]
    with MachineMonitor() as monitor, torch.inference_mode():
        for shape, (out, inp) in (TINY if args.tiny else SHAPES).items():
            for lname in args.layouts.split(","):
                if LAYOUTS[lname][2] in (torch.uint8, torch.int8) and inp % 256:
                    continue  # K-quants need whole 256-weight blocks (GGUF falls back)
                t = random_tensor(LAYOUTS[lname], out, inp)
                usable = {k: v for k, v in kernels.items() if v[1] == 0 or vnni_layout_ok(t)}
                w = t.dequantize()
                for rows in rows_list:
                    x = torch.randn(rows, inp)
                    want = F.linear(x, w)
                    scale = float(want.abs().max())
                    for k, (few, kern) in usable.items():  # checked, and warmed
                        err = float((call(t, x, few, kern) - want).abs().max())
                        if err > 0.02 * scale:
                            raise SystemExit(f"{shape} {lname} {rows} rows: {k} is off by {err}")
                    best = dict.fromkeys(usable, float("inf"))
                    for _ in range(args.repeats):
                        for k, (few, kern) in usable.items():
                            t0 = time.perf_counter()
                            call(t, x, few, kern)
                            best[k] = min(best[k], time.perf_counter() - t0)
                    flops = 2.0 * rows * out * inp
                    cells = [f"{best[k] * 1e3:.3f} ({flops / best[k] / 1e9:.0f})" if k in best
                             else "-" for k in names]
                    others = [v for k, v in best.items() if k != "int8 GEMM"]
                    ratio = (f"{min(others) / best['int8 GEMM']:.2f}x" if "int8 GEMM" in best
                             else "-")
                    print(f"| {shape} | {lname} | {rows} | {' | '.join(cells)} | {ratio} |")
    print(f"# {monitor.report}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
