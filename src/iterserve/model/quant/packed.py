"""Quantized weights as our kernels read them (``csrc/quant_gemm.cpp``), and the
projection over them.

Three layouts cover every format we load, each repacked once at load:

- ``bits=8``: int8 ``qweight [out, in]``; GGUF Q8_0 (group 32),
  ``--quantization int8`` (one group per row).
- ``bits=6``: uint8 ``qweight [out, in/64*48]``, each 64 elements one 48-byte chunk:
  bytes 0-31 hold the low 4 bits of element ``j`` (low nibble) and ``j+32`` (high
  nibble), bytes 32-47 the top 2 bits of elements ``j, j+16, j+32, j+48`` (bits 0-1,
  2-3, 4-5, 6-7); codes 0..63. GGUF Q6_K (group 16): its bits, regrouped so a 64-weight
  chunk unpacks in natural order with two shifts and masks per 32 bytes; GGUF Q5_0
  (group 32, codes 16..47).
- ``bits=4``: uint8 ``qweight [out, in/2]``, each 32 elements one 16-byte chunk whose
  byte ``j`` holds element ``j`` (low nibble) and element ``j+16`` (high nibble), the
  layout of GGUF's Q4_0 blocks; GGUF Q4_0 and Q4_K, ``--quantization int4``.

``scales [out, in/group]`` (float16 where the format's scales are float16, as Q8_0 and
Q4_0's are, else float32) and optional ``mins`` (same shape, not with 6 bits):
``w = s*q - m``; without mins ``w = s*q`` (8-bit), ``w = s*(q-8)`` (4-bit) or
``w = s*(q-32)`` (6-bit). Two-level scales keep llama.cpp's
K-quants as small as in the file: ``scales`` (and ``mins``) uint8 or int8 under a
float32 or float16 ``scale_base`` (``min_base``, the same dtype) per 256 weights of a
row, ``s = base * scale``. A layer may be several such
tensors stacked by output rows (``QuantWeight.parts``): a fused q/k/v projection whose
shards a GGUF file stores in different types (Q4_K_M keeps some v projections in Q6_K).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from iterserve.model import cpu_ops, hugepages

# Few-row kernel up to this many input rows; more take dequantized tiles and a GEMM.
FEW_ROWS_DEFAULT = 8
# ``QuantWeight.gemm_rows`` when the int8 GEMM never runs.
GEMM_ROWS_NEVER = 1 << 30
# The torch fallback dequantizes this many weight elements at a time (never a whole layer).
_TILE_ELEMENTS = 1 << 18


@dataclass
class QuantTensor:
    """One packed [out_features, in_features] weight (see the module doc)."""

    bits: int
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    group: int
    scale_base: torch.Tensor | None = None
    min_base: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.bits not in (4, 6, 8):
            raise ValueError(f"bits must be 4, 6 or 8, got {self.bits}")
        if self.bits == 6:
            if self.qweight.shape[1] % 48:
                raise ValueError(f"a 6-bit qweight has rows of whole 48-byte chunks, got "
                                 f"{self.qweight.shape[1]} bytes")
            if self.mins is not None:
                raise ValueError("mins are not supported with 6 bits")
        unit = 32 if self.bits == 4 else 16
        if self.group % unit or self.in_features % self.group:
            raise ValueError(
                f"group {self.group} must be a multiple of {unit} dividing in_features "
                f"{self.in_features}")
        want = (self.out_features, self.in_features // self.group)
        if tuple(self.scales.shape) != want:
            raise ValueError(f"scales have shape {tuple(self.scales.shape)}, expected {want}")
        if self.mins is not None and self.mins.shape != self.scales.shape:
            raise ValueError("mins must have the shape of scales")
        if self.scale_base is not None:
            if 256 % self.group or self.in_features % 256:
                raise ValueError("two-level scales need a group dividing 256 and rows of "
                                 "whole 256-weight blocks")
            base = (self.out_features, self.in_features // 256)
            if self.scale_base.dtype not in (torch.float32, torch.float16) or (
                    self.min_base is not None and self.min_base.dtype != self.scale_base.dtype):
                raise ValueError("scale_base / min_base must be float32 or float16, one dtype")
            if tuple(self.scale_base.shape) != base or (
                    self.mins is not None and (self.min_base is None
                                               or tuple(self.min_base.shape) != base)):
                raise ValueError(f"scale_base / min_base must have shape {base}")

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[0])

    @property
    def in_features(self) -> int:
        cols = int(self.qweight.shape[1])
        return {8: cols, 4: 2 * cols, 6: cols // 48 * 64}[self.bits]

    def tensors(self) -> list[torch.Tensor | None]:
        return [self.qweight, self.scales, self.mins, self.scale_base, self.min_base]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors() if t is not None)

    def layout(self) -> tuple:
        """What must agree for two tensors to be stacked into one."""
        return (self.bits, self.group, self.scales.dtype, self.mins is not None,
                None if self.scale_base is None else self.scale_base.dtype, self.in_features)

    def _scale(self, t: torch.Tensor, base: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor:
        s = t[lo:hi].float()
        if base is not None:
            s = s * base[lo:hi].float().repeat_interleave(256 // self.group, dim=1)
        return s[..., None]

    def rows(self, index: torch.Tensor) -> QuantTensor:
        """The output rows ``index`` (in that order)."""
        ts = [None if t is None else t[index].contiguous() for t in self.tensors()]
        return QuantTensor(self.bits, ts[0], ts[1], ts[2], self.group, ts[3], ts[4])  # type: ignore[arg-type]

    def dequantize(self, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Rows ``lo:hi`` as float32 (torch ops; the reference the kernels are tested on)."""
        hi = self.out_features if hi is None else hi
        q = self.qweight[lo:hi]
        rows = q.shape[0]
        if self.bits == 8:
            qf = q.float()
        elif self.bits == 6:
            qf = unpack6(q).float() - 32.0
        else:
            b = q.view(rows, -1, 16)
            qf = torch.cat((b & 15, b >> 4), dim=-1).reshape(rows, -1).float()
        s = self._scale(self.scales, self.scale_base, lo, hi)
        qf = qf.view(rows, -1, self.group)
        if self.mins is not None:
            w = qf * s - self._scale(self.mins, self.min_base, lo, hi)
        elif self.bits == 4:
            w = (qf - 8.0) * s
        else:
            w = qf * s
        return w.reshape(rows, self.in_features)


def stack(parts: list[QuantTensor]) -> QuantTensor:
    """The tensors stacked by output rows (same layout)."""
    p0 = parts[0]
    cols = [[p.tensors()[i] for p in parts] for i in range(5)]
    ts = [None if c[0] is None else torch.cat(c) for c in cols]  # type: ignore[arg-type]
    return QuantTensor(p0.bits, ts[0], ts[1], ts[2], p0.group, ts[3], ts[4])  # type: ignore[arg-type]


def merge(parts: list[QuantTensor]) -> list[QuantTensor]:
    """Consecutive parts of one layout stacked, so a layer runs as few kernels as it can."""
    out: list[list[QuantTensor]] = []
    for p in parts:
        if out and out[-1][0].layout() == p.layout():
            out[-1].append(p)
        else:
            out.append([p])
    return [g[0] if len(g) == 1 else stack(g) for g in out]


def _kernel_available() -> bool:
    from iterserve.model import cpu_ops

    return cpu_ops.quant_available()


@dataclass
class QuantWeight:
    """A layer's quantized weight: its parts by output rows, and which kernel runs it."""

    parts: list[QuantTensor]
    use_cpp: bool = field(default_factory=_kernel_available)
    few_rows: int = FEW_ROWS_DEFAULT
    # Few-row inputs quantized to int8 per 32 elements and dotted by VNNI (the parts
    # whose layout it takes); chosen at load by timing (linear.py), else float32 inputs.
    act_int8: bool = False
    # The checkpoint's scheme quantizes inputs per token (W8A8): past ``few_rows`` rows a
    # per-row int8 part runs as one int8 GEMM (``linear_int_mm``).
    act_dynamic_int8: bool = False
    # From this many rows (at least 2) the parts the int8 kernels take run on the int8
    # GEMM (csrc/quant_lanes.h, quant_tile.h); chosen at load by timing (choose.py
    # ``choose_quant_gemm``), else never.
    gemm_rows: int = GEMM_ROWS_NEVER

    def __post_init__(self) -> None:
        self.parts = merge(self.parts)
        if len({p.in_features for p in self.parts}) != 1:
            raise ValueError("the parts of a quantized weight disagree on in_features")
        # Into huge pages now (our kernels stream them every step), while the load
        # still frees each layer's loose parts as the next one reuses their heap: moved
        # at the end, the whole freed model stayed in the heap beside its copy.
        for p in self.parts:
            p.qweight = hugepages.copy(p.qweight)

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W.T + bias`` in float32, returned in ``x``'s dtype."""
        if len(self.parts) == 1 and self._int_mm(x, self.parts[0]):
            return linear_int_mm(x, self.parts[0], bias, self.use_cpp)
        ys = [self._part(x, p) for p in self.parts]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)

    def kernel(self, p: QuantTensor) -> int:
        """The few-row kernel part ``p`` runs on: 1 int8 activations, 0 float32. Past
        ``FEW_ROWS_DEFAULT`` rows (where the few-row threshold is chosen by timing) not
        this choice but ``many_rows_kernel``'s, so that the few-row threshold never
        changes a prompt's numbers."""
        return int(self.act_int8 and vnni_layout_ok(p))

    def many_rows_kernel(self, p: QuantTensor, rows: int) -> int:
        """The kernel ``rows`` run on for part ``p``: 2 the int8 GEMM from ``gemm_rows``
        on; else, past ``FEW_ROWS_DEFAULT`` rows, 0 (float few-row kernel or dequantized
        tiles, by ``few_rows``), and up to it ``kernel``'s choice."""
        if rows >= self.gemm_rows and vnni_layout_ok(p):
            return 2
        return self.kernel(p) if rows <= FEW_ROWS_DEFAULT else 0

    def _int_mm(self, x: torch.Tensor, p: QuantTensor) -> bool:
        return self.act_dynamic_int8 and x.shape[0] > self.few_rows and int_mm_ok(p)

    def _part(self, x: torch.Tensor, p: QuantTensor) -> torch.Tensor:
        rows = x.shape[0]
        if self._int_mm(x, p):
            return linear_int_mm(x.float(), p, None, self.use_cpp)  # float32, as the other parts
        if self.use_cpp:
            kernel = self.many_rows_kernel(p, rows)
            return torch.ops.iterserve_cpu.quant_linear(
                x, p.qweight, p.scales, p.mins, p.scale_base, p.min_base, p.bits, p.group,
                self.few_rows, kernel)
        return linear_torch(x, p)


def vnni_layout_ok(p: QuantTensor) -> bool:
    """Whether the int8-activation kernel takes ``p`` (quant_kernels.h's
    ``vnni_layout_ok``): rows of whole 64-element chunks, groups of 16 (8-bit, 6-bit),
    32, or a multiple of 64."""
    return p.in_features % 64 == 0 and (
        (p.group == 16 and p.bits != 4) or p.group == 32 or p.group % 64 == 0)


class QuantEmbedding(torch.nn.Module):
    """An embedding table kept packed: a lookup dequantizes only the rows it reads."""

    def __init__(self, table: QuantTensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.table = table
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = input_ids.reshape(-1)
        rows = self.table.rows(flat).dequantize().to(self.dtype)
        return rows.view(*input_ids.shape, self.embedding_dim)


def int_mm_ok(p: QuantTensor) -> bool:
    """Whether ``p`` is int8 with one scale per output row and no offsets (compressed-
    tensors W8A8, ``--quantization int8``): many rows then run as one int8 GEMM."""
    return p.bits == 8 and p.group == p.in_features and p.mins is None and p.scale_base is None


def linear_int_mm(x: torch.Tensor, p: QuantTensor, bias: torch.Tensor | None = None,
                  use_cpp: bool = True) -> torch.Tensor:
    """Many rows on a per-row int8 weight, in ``x``'s dtype: the input quantized per row
    (dynamic per-token int8, what W8A8 names), one int8 GEMM (oneDNN's VNNI kernels
    behind ``_int_mm``), then both scales and the bias, in float32 (one pass each in the
    C++ kernel). Nothing of the weight is dequantized."""
    if use_cpp and cpu_ops.quant_available():
        return torch.ops.iterserve_cpu.int8_linear(x, p.qweight, p.scales, bias)
    return int_mm_torch(x, p, bias)


def int_mm_torch(x: torch.Tensor, p: QuantTensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``linear_int_mm`` as a chain of torch ops (its C++ kernel's reference)."""
    xf = x.float()
    sx = xf.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0
    xq = torch.round(xf / sx).clamp_(-127, 127).to(torch.int8)
    y = torch._int_mm(xq, p.qweight.t()).float() * sx * p.scales.float().view(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def linear_torch(x: torch.Tensor, p: QuantTensor) -> torch.Tensor:
    """The torch fallback: float32 tiles of the weight dequantized and multiplied in turn."""
    xf = x.float()
    tile = max(1, _TILE_ELEMENTS // p.in_features)
    if tile >= p.out_features:
        return F.linear(xf, p.dequantize())
    return torch.cat([F.linear(xf, p.dequantize(o, o + tile))
                      for o in range(0, p.out_features, tile)], dim=-1)


# --- quantizing float weights (--quantization int8 / int4) ----------------------------


def quantize_int8(w: torch.Tensor, group: int | None = None) -> QuantTensor:
    """Symmetric int8, one float32 scale per row (``group`` None) or per ``group``."""
    out, inp = w.shape
    g = inp if group is None else group
    wf = w.detach().float().reshape(out, inp // g, g)
    s = wf.abs().amax(-1) / 127.0
    q = torch.round(wf / torch.where(s == 0, 1.0, s)[..., None]).clamp(-127, 127)
    return QuantTensor(8, q.to(torch.int8).reshape(out, inp).contiguous(), s.contiguous(), None, g)


def quantize_int4(w: torch.Tensor, group: int = 32) -> QuantTensor:
    """Asymmetric int4 (scale and min per ``group``), packed in the 4-bit layout."""
    out, inp = w.shape
    wf = w.detach().float().reshape(out, inp // group, group)
    lo, hi = wf.amin(-1), wf.amax(-1)
    s = (hi - lo) / 15.0
    s = torch.where(s == 0, 1.0, s)
    q = torch.round((wf - lo[..., None]) / s[..., None]).clamp(0, 15).to(torch.uint8)
    return QuantTensor(4, pack4(q.reshape(out, inp)), s.contiguous(), (-lo).contiguous(), group)


def pack4(q: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 ``[out, in]`` -> the 4-bit layout ``[out, in/2]``."""
    out, inp = q.shape
    c = q.reshape(out, inp // 32, 2, 16)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(out, inp // 2).contiguous()


def pack6(q: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..63 ``[out, in]`` (in a multiple of 64) -> the 6-bit layout
    ``[out, in/64*48]``."""
    out, inp = q.shape
    c = q.reshape(out, inp // 64, 64)
    low, high = c & 15, c >> 4
    ql = low[..., :32] | (low[..., 32:] << 4)
    h = high.reshape(out, inp // 64, 4, 16)
    qh = h[:, :, 0] | (h[:, :, 1] << 2) | (h[:, :, 2] << 4) | (h[:, :, 3] << 6)
    return torch.cat((ql, qh), dim=-1).reshape(out, inp // 64 * 48).contiguous()


def unpack6(b: torch.Tensor) -> torch.Tensor:
    """The 6-bit layout ``[rows, in/64*48]`` -> its uint8 codes 0..63 ``[rows, in]``."""
    rows = b.shape[0]
    c = b.reshape(rows, -1, 48)
    ql, qh = c[..., :32], c[..., 32:]
    low = torch.cat((ql & 15, ql >> 4), dim=-1)
    high = torch.cat([(qh >> (2 * i)) & 3 for i in range(4)], dim=-1)
    return (low | (high << 4)).reshape(rows, -1)
