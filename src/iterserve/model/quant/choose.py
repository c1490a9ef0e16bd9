"""Which kernel a group of quantized projections (the same role across layers) runs on,
timed at load on the model's own weights as ``linear.prepare_linears`` times the float
projections' kernels:

- activations: float32 inputs (each weight widened in registers) or int8 inputs (the
  input quantized per 32 elements, the dot products on AVX-512 VNNI), for one row, the
  batch-1 decode step; ``ITERSERVE_QUANT_ACT=float|int8`` pins it (``auto``, default,
  times them). The int8 path costs accuracy as llama.cpp's does (its ``q8_0``
  activations): about 0.4% of each output's scale, random inputs (tests/model/
  test_quant_packed.py).
- up to how many rows the few-row kernel runs rather than dequantized tiles and a GEMM.
- from how many rows the int8 GEMM (the input quantized as for the few-row int8 kernel;
  16 output rows to a register for Q8_0 / Q4_0 layouts, csrc/quant_lanes.h, register
  tiles over blocks of weight rows in cache for the others, csrc/quant_tile.h) runs
  rather than that, from 2 rows on; ``ITERSERVE_QUANT_ACT`` pins it as it pins the
  activations (``float``: never, ``int8``: past ``FEW_ROWS_DEFAULT`` rows).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from iterserve.model import cpu_ops
from iterserve.model.quant.packed import (
    FEW_ROWS_DEFAULT,
    GEMM_ROWS_NEVER,
    QuantTensor,
    vnni_layout_ok,
)

QUANT_PROBE_ROWS = (2, 4, 8, 16, 64)
# The int8 GEMM's probes (past the largest, its per-call costs only amortize further).
GEMM_PROBE_ROWS = QUANT_PROBE_ROWS
# Few-row kernel for every row count when it wins at every probe: past the largest
# probe both costs grow linearly in the rows (the tiles' dequantization is per call).
FEW_ROWS_UNBOUNDED = 1 << 30
QUANT_ACT_MODES = ("auto", "float", "int8")
# int8 activations only where clearly faster: they cost a little accuracy.
_INT8_MARGIN = 0.95

Timer = Callable[[Callable[[], Any], int], float]


def quant_act_mode() -> str:
    """``ITERSERVE_QUANT_ACT`` (auto | float | int8)."""
    mode = os.environ.get("ITERSERVE_QUANT_ACT", "").strip().lower() or "auto"
    if mode not in QUANT_ACT_MODES:
        raise ValueError(f"ITERSERVE_QUANT_ACT must be one of {', '.join(QUANT_ACT_MODES)}, "
                         f"got {mode!r}")
    return mode


def choose_quant_act(group: Sequence[Any], best_time: Timer, rounds: int = 5) -> bool:
    """Whether the group's layers take int8 activations (sets each ``quant.act_int8``):
    one row through every layer (its weights streaming from memory, as in a step) on
    each kernel, taking turns, int8 kept when clearly faster."""
    quants = [m.quant for m in group if m.quant is not None]
    mode = quant_act_mode()
    usable = (quants and all(q.use_cpp for q in quants) and cpu_ops.vnni_available()
              and any(vnni_layout_ok(p) for q in quants for p in q.parts))
    if not usable or mode == "float":
        choice = False
    elif mode == "int8":
        choice = True
    else:
        x = torch.randn(1, group[0].in_features)

        def one_pass() -> None:
            for layer in group:
                layer(x)

        times = {False: float("inf"), True: float("inf")}
        for _ in range(rounds):
            for on in (False, True):
                for q in quants:
                    q.act_int8 = on
                times[on] = min(times[on], best_time(one_pass, 1))
        choice = times[True] < _INT8_MARGIN * times[False]
    for q in quants:
        q.act_int8 = bool(choice)
        if choice:
            for p in q.parts:
                narrow_scales(p)
    return bool(choice)


def narrow_scales(p: QuantTensor) -> None:
    """float32 one-level scales (and mins) that are float16 values (GGUF's, widened at
    load for the float-activation kernel, which reads float32 fastest) back to float16:
    0.5 bits a weight less to stream; the int8 kernel widens 16 at a time per row."""
    if p.scale_base is not None or p.scales.dtype != torch.float32 or not vnni_layout_ok(p):
        return
    ts = [p.scales] if p.mins is None else [p.scales, p.mins]
    half = [t.half() for t in ts]
    if all(torch.equal(h.float(), t) for h, t in zip(half, ts)):
        p.scales = half[0]
        if p.mins is not None:
            p.mins = half[1]


def choose_quant_rows(group: Sequence[Any], best_time: Timer, rounds: int = 3) -> int:
    """Up to how many rows a group of quantized layers takes the few-row kernel (each
    weight row streamed once for all rows) rather than dequantized tiles and a GEMM: the
    largest probe row count up to which one pass through the group (its weights
    streaming from memory, as in a step) is faster on it at every probe; 1 for none,
    ``FEW_ROWS_UNBOUNDED`` when it wins at every probe (decode batches of 16-64 rows
    would otherwise pay a whole dequantization per step)."""
    quants = [m.quant for m in group if m.quant is not None]
    if not quants or not all(q.use_cpp for q in quants):
        return quants[0].few_rows if quants else 0
    xs = {r: torch.randn(r, group[0].in_features) for r in QUANT_PROBE_ROWS}

    def one_pass(x: torch.Tensor) -> None:
        for layer in group:
            layer(x)

    times = {(r, few): float("inf") for r in QUANT_PROBE_ROWS for few in (False, True)}
    for _ in range(rounds):
        for few in (False, True):
            for q in quants:
                q.few_rows = max(QUANT_PROBE_ROWS) if few else 1
            for r, x in xs.items():
                times[r, few] = min(times[r, few], best_time(functools.partial(one_pass, x), 1))
    best = FEW_ROWS_UNBOUNDED
    for prev, r in zip((1, *QUANT_PROBE_ROWS), QUANT_PROBE_ROWS):
        if times[r, True] >= times[r, False]:
            best = prev
            break
    for q in quants:
        q.few_rows = best
    return best


def choose_quant_gemm(group: Sequence[Any], best_time: Timer, rounds: int = 3) -> int:
    """From how many rows a group of quantized layers takes the int8 GEMM (sets each
    ``quant.gemm_rows``; after ``choose_quant_rows``, whose choice it is timed against):
    one pass through the group at each of ``GEMM_PROBE_ROWS`` on both, taking turns;
    from the smallest probe range from which on it is clearly faster at every probe
    (it costs the int8 activations' accuracy), else ``GEMM_ROWS_NEVER``."""
    quants = [m.quant for m in group if m.quant is not None]
    mode = quant_act_mode()
    usable = (quants and all(q.use_cpp for q in quants) and cpu_ops.vnni_available()
              and any(vnni_layout_ok(p) for q in quants for p in q.parts))
    on_rows = FEW_ROWS_DEFAULT + 1
    if not usable or mode == "float":
        best = GEMM_ROWS_NEVER
    elif mode == "int8":
        best = on_rows
    else:
        xs = {r: torch.randn(r, group[0].in_features) for r in GEMM_PROBE_ROWS}

        def one_pass(x: torch.Tensor) -> None:
            for layer in group:
                layer(x)

        times = {(r, on): float("inf") for r in GEMM_PROBE_ROWS for on in (False, True)}
        for _ in range(rounds):
            for on in (False, True):
                for q in quants:
                    q.gemm_rows = on_rows if on else GEMM_ROWS_NEVER
                for r, x in xs.items():
                    times[r, on] = min(times[r, on], best_time(functools.partial(one_pass, x), 1))
        best = GEMM_ROWS_NEVER
        lower = (1, *GEMM_PROBE_ROWS[:-1])
        for lo, r in reversed(list(zip(lower, GEMM_PROBE_ROWS))):
            if times[r, True] >= _INT8_MARGIN * times[r, False]:
                break
            best = lo + 1
    for q in quants:
        q.gemm_rows = best
    return best
