"""Projections for inference, and which CPU kernel each one runs on this machine.

A decode step is a chain of skinny matmuls, so on CPU the kernel behind each projection
matters more than anything else in the step:

- Several rows (prefill chunks, decode batches): MKL's sgemm repacks the weight on
  every call, which dominates decode batches (2-256 rows). The candidates are a weight
  packed once by MKL itself (float32, our C++ op ``csrc/packed_gemm.cpp``), one
  prepacked by oneDNN (in the weight's dtype), and plain F.linear. Which is fastest
  depends on the CPU (MKL takes a slow path on AMD cores), the dtype (a CPU with bf16
  instructions runs oneDNN's bf16 GEMM several times faster than any float32 one) and
  the thread count, so ``prepare_linears`` times them on the model's own weights at
  load and packs for the fastest (measured: docs/benchmarks.md).
- One row (batch-1 decode) is a GEMV, bound by how fast the weights stream from
  memory. MKL's sgemv uses one core whatever the thread count, so with 2 threads it
  gets about half the machine's bandwidth. Cutting the weight into ``threads`` slices
  and multiplying them as one batched matmul puts each core on its own slice (torch
  runs bmm's batch in parallel), well above the plain GEMV's bandwidth with 2
  threads. Whether that pays, and which slicing (row slices of the row-major
  weight, or column-major slices), depends on the shape, the CPU and the thread
  count, so ``prepare_linears`` times the candidates on the model's own weights at
  load and keeps the fastest.
- With the cpp backend (our C++ kernels, ``cpu_ops``), a third candidate: their GEMV
  streams each thread's rows as one prefetched run, ~90% of a plain memory read's
  bandwidth.
- Two to four rows (small decode batches) are still bound by the weights' stream, which
  GEMM libraries read well below the GEMV's rate. On AVX-512 CPUs with the cpp backend
  our few-row kernel (``csrc/skinny_gemm.cpp``) streams each weight row once for all
  the rows; ``prepare_linears`` times it per role (all q/k/v projections, ...) against
  the multi-row kernel chosen above, with the weights streaming from memory as in a
  step, and keeps it up to the row count where it stops being clearly faster.
- Five to a few dozen rows of a bfloat16 model (mid-size decode batches) on AVX-512 CPUs
  without AMX: oneDNN's bfloat16 GEMM runs at half the FMA rate there, and MKL's float32
  GEMM on a widened copy streams twice the bytes. Our pair GEMM (``csrc/pair_gemm.cpp``)
  streams a pair-packed bfloat16 copy once and widens it in registers for the FMAs;
  ``prepare_linears`` times it per role as the few-row kernel, at 8 to 64 rows.

A quantized layer (``Linear.quant``, set by ``set_quant``: GGUF files, ``--quantization``)
keeps its weight packed and runs the kernels of ``model/quant/packed.py``; none of the
above applies to it, and its float ``weight`` is a zero-stride placeholder of the right
shape.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from iterserve.model import cpu_ops
from iterserve.model.quant.choose import (
    QUANT_PROBE_ROWS,
    choose_quant_act,
    choose_quant_gemm,
    choose_quant_rows,
)
from iterserve.model.quant.packed import QuantWeight

__all__ = ["QUANT_PROBE_ROWS", "Linear", "prepare_linears", "set_gemv_mode", "set_quant"]


# CPUs without bf16 units run bf16 matmuls several times slower than float32:
# there, a bf16 model keeps bf16 weights and activations but multiplies in float32
# whenever more than one row shares the weights (a single-row GEMV is memory bound
# and stays native). Set per process; see Linear.
UPCAST_BF16_MATMUL_ROWS = None if cpu_ops.cpu_has_native_bf16() else 1

def _packed_weights_max_bytes() -> int:
    """A sixth of the machine's memory, at least 2 GiB: the copies take up to about
    twice the projections' bytes, so model and copies stay within half of it."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        total = 0
    return max(2 << 30, total // 6)


# Extra weight copies (oneDNN-packed, GEMV slices) only when the model's projections
# take at most this much: small CPU models are where they pay, and they cost memory.
PACKED_WEIGHTS_MAX_BYTES = _packed_weights_max_bytes()

GEMV_MODES = ("plain", "rows", "cols", "cpp")


class Linear(nn.Linear):
    """nn.Linear plus optional per-machine kernels: a oneDNN-prepacked weight for
    multi-row inputs and a sliced weight for single-row inputs (see the module doc)."""

    packed_weight: torch.Tensor | None = None
    packed_kind: str = "onednn"  # or "mkl": which library packed it (and multiplies)
    # "rows": [s, out/s, in] row slices; "cols": [s, in, out/s] column-major slices;
    # "cpp": the row-major [out, in] weight for our C++ kernel.
    gemv_weight: torch.Tensor | None = None
    gemv_mode: str = "plain"
    # Inputs of 2..skinny_rows rows take our few-row kernel over this row-major weight.
    skinny_weight: torch.Tensor | None = None
    skinny_rows: int = 0
    # Inputs of up to pair_rows rows (above skinny_rows) take the pair GEMM over this
    # pair-packed bfloat16 copy (``pack_pairs``).
    pair_weight: torch.Tensor | None = None
    pair_rows: int = 0
    # A packed quantized weight (model/quant/packed.py); None for a float layer.
    quant: QuantWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.linear(x, self.bias)
        w = self.weight
        rows = x.shape[0]
        if rows == 1 and self.gemv_weight is not None:
            if self.gemv_mode == "cpp":  # a C++ op: as cheap to call compiled as eager
                return torch.ops.iterserve_cpu.gemv(x, self.gemv_weight, self.bias)
            if torch.compiler.is_compiling():
                # Inductor would rewrite a one-row bmm into its own (slower) loops.
                return torch.ops.iterserve.split_gemv(
                    x, self.gemv_weight, self.gemv_mode == "rows", self.bias
                )
            return split_gemv(x, self.gemv_weight, self.gemv_mode == "rows", self.bias)
        if rows <= self.skinny_rows and self.skinny_weight is not None:  # a C++ op
            return torch.ops.iterserve_cpu.skinny_linear(x, self.skinny_weight, self.bias)
        if rows <= self.pair_rows and self.pair_weight is not None:  # a C++ op
            return torch.ops.iterserve_cpu.pair_linear(x, self.pair_weight, self.bias)
        if self.packed_weight is not None and rows > 1:
            if self.packed_kind == "mkl":  # a C++ op: as cheap to call compiled as eager
                if x.dtype == torch.float32:
                    return torch.ops.iterserve_cpu.mkl_packed_linear(
                        x, self.packed_weight, self.out_features, self.bias
                    )
                # A bfloat16 model: multiplied in float32 on the packed float32 copy.
                b = None if self.bias is None else self.bias.float()
                return torch.ops.iterserve_cpu.mkl_packed_linear(
                    x.float(), self.packed_weight, self.out_features, b
                ).to(x.dtype)
            if torch.compiler.is_compiling():
                # Inductor lowers the oneDNN op only for frozen weights: call it opaquely.
                return torch.ops.iterserve.packed_linear(x, self.packed_weight, self.bias)
            return _packed_linear(x, self.packed_weight, self.bias)
        if (
            w.dtype == torch.bfloat16
            and UPCAST_BF16_MATMUL_ROWS is not None
            and rows > UPCAST_BF16_MATMUL_ROWS
            and w.device.type == "cpu"
        ):
            b = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), w.float(), b).to(x.dtype)
        return F.linear(x, w, self.bias)


def set_quant(layer: Linear, quant: QuantWeight) -> None:
    """Make ``layer`` run on the packed weight ``quant``, releasing its float weight."""
    if (quant.out_features, quant.in_features) != (layer.out_features, layer.in_features):
        raise ValueError(
            f"quantized weight of shape {(quant.out_features, quant.in_features)} does not "
            f"fit a [{layer.out_features}, {layer.in_features}] projection")
    w = layer.weight
    layer.weight = nn.Parameter(
        torch.zeros(1, dtype=w.dtype, device=w.device).expand(w.shape), requires_grad=False)
    layer.quant = quant
    layer.gemv_weight = layer.packed_weight = layer.skinny_weight = layer.pair_weight = None
    layer.gemv_mode, layer.skinny_rows, layer.pair_rows = "plain", 0, 0


def split_gemv(
    x: torch.Tensor, gw: torch.Tensor, row_slices: bool, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x [1, in] @ W.T`` as one bmm over the weight's slices (one slice per core)."""
    s = gw.shape[0]
    if row_slices:  # [s, out/s, in] @ [s, in, 1] -> [s, out/s, 1]
        y = torch.bmm(gw, x.t().unsqueeze(0).expand(s, -1, -1))
    else:  # [s, 1, in] @ [s, in, out/s] -> [s, 1, out/s]
        y = torch.bmm(x.unsqueeze(0).expand(s, -1, -1), gw)
    y = y.reshape(1, -1)  # the slices are consecutive output ranges
    return y if bias is None else y + bias


def set_gemv_mode(layer: Linear, mode: str, slices: int) -> bool:
    """Give ``layer`` the single-row kernel ``mode`` with ``slices`` slices; False (and
    plain) when the output dimension does not split evenly."""
    w = layer.weight.detach()
    out, inp = w.shape
    layer.gemv_weight, layer.gemv_mode = None, "plain"
    if mode == "cpp":
        if w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16):
            return False
        if not cpu_ops.available():
            return False
        layer.gemv_weight, layer.gemv_mode = w.contiguous(), mode
        return True
    if mode == "plain" or slices < 1 or out % slices:
        return mode == "plain"
    if mode == "rows":
        gw = w.contiguous().view(slices, out // slices, inp)
    elif mode == "cols":
        gw = w.view(slices, out // slices, inp).transpose(1, 2).contiguous()
    else:
        raise ValueError(f"gemv mode must be one of {GEMV_MODES}, got {mode!r}")
    layer.gemv_weight, layer.gemv_mode = gw, mode
    return True


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


_lib = torch.library.Library("iterserve", "FRAGMENT")
_lib.define("packed_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor")
_lib.impl("packed_linear", _packed_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("iterserve::packed_linear", lib=_lib)
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # The packed copy keeps the plain weight's logical [out, in] shape.
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


_lib.define("split_gemv(Tensor x, Tensor gw, bool row_slices, Tensor? bias) -> Tensor")
_lib.impl("split_gemv", split_gemv, "CompositeExplicitAutograd")


@torch.library.register_fake("iterserve::split_gemv", lib=_lib)
def _(x: torch.Tensor, gw: torch.Tensor, row_slices: bool, bias: torch.Tensor | None) -> torch.Tensor:
    out = gw.shape[0] * (gw.shape[1] if row_slices else gw.shape[2])
    return x.new_empty((1, out))


def _best_time(fn, reps: int) -> float:
    with torch.inference_mode():
        fn()
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
    return best


# Row counts a step's multi-row matmuls take: decode batches and prefill chunks.
MULTIROW_PROBE_ROWS = (8, 64, 512)


def _pack(m: Linear, kind: str) -> None:
    """Give ``m`` a packed copy of its weight for ``kind``'s GEMM ("mkl": float32 by
    MKL, our C++ op; "onednn": oneDNN's layout in the weight's own dtype)."""
    w = m.weight.detach()
    if kind == "mkl":
        m.packed_weight = torch.ops.iterserve_cpu.mkl_pack_weight(w.float(), 64)
    else:
        m.packed_weight = torch.ops.mkldnn._reorder_linear_weight(w.contiguous())
    m.packed_kind = kind


def _multirow_kinds(layers: Sequence[Linear], cpp: bool) -> list[str]:
    """The multi-row kernels that can run these layers here, "plain" (F.linear) first."""
    w0 = layers[0].weight
    kinds = ["plain"]
    if w0.device.type != "cpu" or w0.dtype not in (torch.float32, torch.bfloat16):
        return kinds
    if (cpp and cpu_ops.available() and torch.ops.iterserve_cpu.mkl_pack_available()
            and sum(m.weight.numel() * 4 for m in layers) <= PACKED_WEIGHTS_MAX_BYTES):
        kinds.append("mkl")  # float32 copies: a bfloat16 model's take twice its weights
    if (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and (w0.dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported())):
        kinds.append("onednn")
    return kinds


def _time_multirow(layer: Linear, kinds: Sequence[str], rows: Sequence[int] = MULTIROW_PROBE_ROWS,
                   rounds: int = 3) -> dict[str, float]:
    """Each kernel's time on ``layer`` at each row count, relative to plain F.linear and
    averaged over the row counts; the kernels take turns, so a noisy moment hits them
    alike. Which one wins depends on the CPU (MKL runs far below its Intel speed on
    AMD cores, where oneDNN does not), the dtype and the thread count."""
    xs = [torch.randn(r, layer.in_features, dtype=layer.weight.dtype) for r in rows]
    packs: dict[str, tuple[torch.Tensor | None, str]] = {}
    for kind in kinds:
        if kind == "plain":
            packs[kind] = (None, "onednn")
        else:
            _pack(layer, kind)
            packs[kind] = (layer.packed_weight, layer.packed_kind)
    times = {k: [float("inf")] * len(xs) for k in kinds}
    for _ in range(rounds):
        for kind in kinds:
            layer.packed_weight, layer.packed_kind = packs[kind]
            for i, x in enumerate(xs):
                times[kind][i] = min(times[kind][i], _best_time(lambda x=x: layer(x), 1))
    layer.packed_weight, layer.packed_kind = None, "onednn"
    return {k: sum(t / p for t, p in zip(times[k], times["plain"])) / len(xs) for k in kinds}


def _choose_packing(groups: dict[str, list[Linear]], layers: Sequence[Linear], cpp: bool) -> str | bool:
    """Pack every layer for the multi-row kernel that times fastest on the model's
    largest projection (not the vocabulary head, which is atypical); plain F.linear
    unless a packed kernel is clearly (10%) faster. Returns the kind, or False."""
    kinds = _multirow_kinds(layers, cpp)
    if len(kinds) == 1:
        return False
    probe = [m for name, g in groups.items() if name != "lm_head" for m in g] or list(layers)
    try:
        scores = _time_multirow(max(probe, key=lambda m: m.weight.numel()), kinds)
    except (RuntimeError, AttributeError):  # a kernel missing or unsupported here
        return False
    for kind in sorted(scores, key=scores.__getitem__):
        if kind == "plain" or scores[kind] > 0.9:
            return False
        if kind == "mkl" and _mkl_pack(layers):
            return "mkl"
        if kind == "onednn":
            with torch.inference_mode():
                for m in layers:
                    _pack(m, "onednn")
            return "onednn"
    return False


def warm_up_multirow(layers: Sequence[Linear], max_rows: int) -> int:
    """Run each distinct projection (shape, dtype, kernel) once at every row count from
    2 to ``max_rows`` (the decode batch sizes). oneDNN, packed or behind F.linear,
    builds a primitive for every new input shape, 0.3-0.6 ms each for a small model's
    shapes here: otherwise the first decode step at each batch size pays it once per
    shape, which shows in a server's first minutes of TPOT. Returns the shapes warmed."""
    seen: dict[tuple, Linear] = {}
    for m in layers:
        if m.quant is not None:
            continue  # no per-shape state in its kernels
        kind = m.packed_kind if m.packed_weight is not None else "plain"
        seen.setdefault((m.in_features, m.out_features, m.weight.dtype, m.bias is None, kind), m)
    with torch.inference_mode():
        for m in seen.values():
            for rows in range(2, max_rows + 1):
                m(torch.zeros(rows, m.in_features, dtype=m.weight.dtype))
    return len(seen)


def _mkl_pack(layers: Sequence[Linear]) -> bool:
    """Pack every weight with MKL (our C++ op), in float32 (a bfloat16 weight too: its
    multi-row matmuls then run in float32, as transformers' bfloat16 matmuls accumulate;
    on CPUs whose bf16 GEMM is slow this is the fastest bf16 path). True when all are
    packed and a check on a few odd batch sizes matches F.linear (the packed layout is
    MKL's to define: never trust it unchecked)."""
    w0 = layers[0].weight
    with torch.inference_mode():
        for m in layers:
            _pack(m, "mkl")
        probe = layers[0]
        for rows in (2, 37, 300):
            x = torch.randn(rows, probe.in_features).to(w0.dtype)
            b = None if probe.bias is None else probe.bias.float()
            want = F.linear(x.float(), probe.weight.float(), b).to(w0.dtype).float()
            got = probe(x).float()
            tol = 1e-4 if w0.dtype == torch.float32 else 1e-2  # bf16: one rounding of the output
            if not torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max())):
                for m in layers:
                    m.packed_weight, m.packed_kind = None, "onednn"
                return False
    return True


def _choose_gemv(group: Sequence[Linear], slices: int, cpp: bool, rounds: int = 5) -> str:
    """Time one row through every layer of the group (the weights stream from memory
    as in a real step, not from cache) with each kernel, the kernels taking turns so
    that a noisy moment hits them alike; keep a sliced one only when it is clearly
    (10%) faster than the plain GEMV, and our C++ one unless another is clearly faster."""
    x = torch.randn(1, group[0].in_features, dtype=group[0].weight.dtype)
    candidates: dict[str, list[tuple[torch.Tensor | None, str]]] = {}
    for mode in GEMV_MODES:
        if slices < 2 and mode in ("rows", "cols"):
            continue  # one slice is the plain GEMV
        if mode == "cpp" and not cpp:
            continue
        if all(set_gemv_mode(layer, mode, slices) for layer in group):
            candidates[mode] = [(layer.gemv_weight, layer.gemv_mode) for layer in group]

    def use(mode: str) -> None:
        for layer, (gw, m) in zip(group, candidates[mode]):
            layer.gemv_weight, layer.gemv_mode = gw, m

    def one_pass() -> None:
        for layer in group:
            layer(x)

    times = dict.fromkeys(candidates, float("inf"))
    for _ in range(rounds):
        for mode in candidates:
            use(mode)
            times[mode] = min(times[mode], _best_time(one_pass, 1))
    best = min(times, key=times.__getitem__)
    if "cpp" in times and times["cpp"] <= 1.1 * times[best]:
        # Our kernel unless another is clearly faster: a load-time timing on a busy
        # machine is noisy, and the C++ kernel is also the cheapest call.
        best = "cpp"
    elif best != "plain" and times[best] > 0.9 * times["plain"]:
        best = "plain"
    use(best)
    return best


SKINNY_PROBE_ROWS = (2, 3, 4)


def _choose_skinny(group: Sequence[Linear], rounds: int = 3) -> int:
    """Up to how many rows the group's layers take our few-row kernel (csrc/skinny_gemm.cpp;
    AVX-512): the most rows r such that at every row count up to r one pass through the
    group (its weights streaming from memory, as in a real step) is clearly (10%) faster
    on it than on the multi-row kernel already chosen; 0 for none."""
    if not cpu_ops.skinny_available():
        return 0
    weights = []
    for m in group:
        w = m.gemv_weight if m.gemv_mode in ("cpp", "rows") else m.weight.detach()
        if w is None or m.in_features % 16 or w.dtype not in (torch.float32, torch.bfloat16):
            return 0
        w = w.reshape(m.out_features, m.in_features)
        if not w.is_contiguous():
            return 0
        weights.append(w)
    xs = {r: torch.randn(r, group[0].in_features, dtype=group[0].weight.dtype) for r in SKINNY_PROBE_ROWS}

    def one_pass(x: torch.Tensor) -> None:
        for layer in group:
            layer(x)

    times = {(r, on): float("inf") for r in SKINNY_PROBE_ROWS for on in (False, True)}
    for _ in range(rounds):
        for on in (False, True):
            for m, w in zip(group, weights):
                m.skinny_weight, m.skinny_rows = (w, max(SKINNY_PROBE_ROWS)) if on else (None, 0)
            for r, x in xs.items():
                times[r, on] = min(times[r, on], _best_time(lambda x=x: one_pass(x), 1))
    best = 0
    for r in SKINNY_PROBE_ROWS:
        if times[r, True] > 0.9 * times[r, False]:
            break
        best = r
    for m, w in zip(group, weights):
        m.skinny_weight, m.skinny_rows = (w, best) if best else (None, 0)
    return best


def pack_pairs(w: torch.Tensor) -> torch.Tensor:
    """Weights [..., N, K] in the pair kernels' layout [..., N / 16, K / 2, 16, 2]:
    column blocks of 16 outputs, input pairs interleaved (csrc/pair_tile.h)."""
    *lead, n, k = w.shape
    perm = (*range(len(lead)), len(lead), len(lead) + 2, len(lead) + 1, len(lead) + 3)
    return w.reshape(*lead, n // 16, 16, k // 2, 2).permute(*perm).contiguous()


# Row counts at which the pair GEMM is timed against the multi-row kernel: mid-size
# decode batches (it loses to MKL's packed GEMM on prefill chunks).
PAIR_PROBE_ROWS = (8, 16, 32, 64)


def _choose_pair(group: Sequence[Linear], skinny_rows: int, rounds: int = 2) -> int:
    """Up to how many rows the group's bfloat16 layers take the pair GEMM: the most rows
    r (from ``PAIR_PROBE_ROWS``) such that at every probe up to r one pass through the
    group is clearly (10%) faster on it than on the kernels already chosen; 0 for none
    (then no pair copy is kept)."""
    if not cpu_ops.pair_available() or not all(
        m.weight.dtype == torch.bfloat16 and m.out_features % 32 == 0 and m.in_features % 2 == 0
        for m in group
    ):
        return 0
    packed = [pack_pairs(m.weight.detach()) for m in group]
    xs = {r: torch.randn(r, group[0].in_features, dtype=torch.bfloat16) for r in PAIR_PROBE_ROWS
          if r > skinny_rows}

    def one_pass(x: torch.Tensor) -> None:
        for layer in group:
            layer(x)

    times = {(r, on): float("inf") for r in xs for on in (False, True)}
    best = 0
    for r, x in xs.items():
        for _ in range(rounds):
            for on in (False, True):
                for m, p in zip(group, packed):
                    m.pair_weight, m.pair_rows = (p, r) if on else (None, 0)
                times[r, on] = min(times[r, on], _best_time(lambda x=x: one_pass(x), 1))
        if times[r, True] > 0.9 * times[r, False]:
            break
        best = r
    for m, p in zip(group, packed):
        m.pair_weight, m.pair_rows = (p, best) if best else (None, 0)
    return best


def prepare_linears(
    groups: dict[str, list[Linear]],
    tied: Sequence[Linear] = (),
    *,
    packed_weights: bool = True,
    gemv: str = "auto",
    cpp: bool = False,
) -> dict:
    """Lay out and pick kernels for every projection; ``groups`` are the same role
    across layers (all q/k/v projections, all down projections, ...) by name, ``tied``
    the layers whose weight is shared with the embedding (left row-major).
    ``packed_weights``, ``gemv`` and ``cpp`` (whether our C++ kernels may be used)
    come from the model's ``BackendConfig`` and the backend chosen for it.

    Float32 weights are stored column-major (the [in, out] matrix contiguous): with
    that operand contiguous MKL takes its plain path, which reads weights about twice
    as fast for skinny matmuls (the 32000x512 lm_head at batch 1: 6.0 ms row-major,
    3.0 ms column-major). Returns the choices made, for the log.
    """
    chosen: dict = {"packed": False, "gemv": {}}
    for name, g in groups.items():
        quantized = [m for m in g if m.quant is not None]
        if quantized and cpp and gemv == "auto":
            chosen.setdefault("quant_act_int8", {})[name] = choose_quant_act(quantized, _best_time)
            chosen.setdefault("quant_few_rows", {})[name] = choose_quant_rows(quantized, _best_time)
            chosen.setdefault("quant_gemm_rows", {})[name] = choose_quant_gemm(quantized, _best_time)
    groups = {name: [m for m in g if m.quant is None] for name, g in groups.items()}
    groups = {name: g for name, g in groups.items() if g}
    layers = [m for g in groups.values() for m in g]
    for m in layers:
        if m.weight.dtype == torch.float32 and m not in tied:
            m.weight.data = m.weight.data.t().contiguous().t()
    nbytes = sum(m.weight.numel() * m.weight.element_size() for m in layers)
    if not layers or nbytes > PACKED_WEIGHTS_MAX_BYTES or layers[0].weight.device.type != "cpu":
        return chosen
    if packed_weights:
        chosen["packed"] = _choose_packing(groups, layers, cpp)
    threads = torch.get_num_threads()
    for name, group in groups.items():
        if gemv != "auto":  # tests and experiments: this mode, at least 2 slices
            ok = (gemv != "cpp" or cpp) and all(
                [set_gemv_mode(m, gemv, max(2, threads)) for m in group])
            chosen["gemv"][name] = gemv if ok else "plain"
        elif threads >= 2 or cpp:
            chosen["gemv"][name] = _choose_gemv(group, threads, cpp)
        if cpp and gemv == "auto":
            skinny = chosen.setdefault("skinny_rows", {})[name] = _choose_skinny(group)
            # The pair copy is one more copy of the weights: only for models of at most
            # half the packed-weights budget (weights + MKL's float32 copy + it in a third
            # of memory).
            chosen.setdefault("pair_rows", {})[name] = (
                _choose_pair(group, skinny) if 2 * nbytes <= PACKED_WEIGHTS_MAX_BYTES else 0)
        if chosen["packed"]:
            for m in group:
                if m.gemv_mode in ("rows", "cpp") and m.gemv_weight is not None:
                    # One row-major copy serves both: single rows take the slices (or
                    # the C++ kernel), more rows the packed weight, so the column-major
                    # one is dead weight.
                    m.weight.data = m.gemv_weight.view(m.weight.shape)
    return chosen
