"""GGUF tensor data (llama.cpp's block formats) -> our packed layouts or float tensors.

Each supported block format maps exactly (no rounding) onto a layout of ``packed``:

========  =====================================  ===================================
type      GGUF block                             ours
========  =====================================  ===================================
Q8_0      32 x int8, float16 d                   8-bit, group 32, float32 scales
Q4_0      32 x 4-bit (q - 8), float16 d          4-bit, group 32, float32 scales
Q5_0      32 x 5-bit (q - 16), float16 d         6-bit (codes q + 16), group 32,
                                                 float32 scales (8-bit where a row
                                                 is not whole 64-weight chunks)
Q4_K      256: 8 x 32 x 4-bit, 6-bit scales and  4-bit, group 32, uint8 scales and
          mins under float16 d and dmin          mins under float32 bases d, dmin
Q6_K      256: 16 x 16 x 6-bit (q - 32), int8    6-bit, group 16, int8 scales under
          scales under a float16 d               a float16 base d (as small as the file)
========  =====================================  ===================================

F32, F16 and BF16 tensors load as float tensors. One-level scales widen to float32 at
load (exactly): the kernels then read them without a half-to-float conversion per group,
which halved the few-row kernel's time per call (0.5 bits more per weight).
"""

from __future__ import annotations

import numpy as np
import torch

from iterserve.model.quant.packed import QuantTensor, pack6

FLOAT_TYPES = ("F32", "F16", "BF16")
# Q5_0: llama-quantize's fallback in Q4_K_M files for rows not a multiple of 256.
QUANT_TYPES = ("Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q6_K")
SUPPORTED_TYPES = FLOAT_TYPES + QUANT_TYPES
QK_K = 256


def type_name(ttype: object) -> str:
    return getattr(ttype, "name", str(ttype))


def unsupported(name: str, ttype: object) -> ValueError:
    return ValueError(
        f"GGUF tensor {name!r} has type {type_name(ttype)}, which iterserve does not load; "
        f"supported: {', '.join(SUPPORTED_TYPES)}")


def dense(data: np.ndarray, ttype: object, shape: tuple[int, ...], name: str) -> torch.Tensor:
    """A float tensor (F32 / F16 / BF16 stored, or a quantized one dequantized by gguf-py)
    of ``shape`` (rows first, as Hugging Face stores it)."""
    from gguf import quants

    t = type_name(ttype)
    if t == "F32":
        arr = np.array(data, dtype=np.float32)  # a copy: the file's pages are read-only
    elif t == "F16":
        arr = np.asarray(data).view(np.float16).astype(np.float32)
    elif t == "BF16":
        u = np.asarray(data).view(np.uint16).astype(np.uint32) << 16
        arr = u.view(np.float32)
    elif t in QUANT_TYPES:
        arr = quants.dequantize(np.asarray(data), ttype)  # type: ignore[arg-type]
    else:
        raise unsupported(name, ttype)
    return torch.from_numpy(np.ascontiguousarray(arr).reshape(shape))


def packed(data: np.ndarray, ttype: object, rows: int, cols: int, name: str) -> QuantTensor:
    """A 2-D quantized tensor ``[rows, cols]`` as our packed layout (copied out of the file)."""
    t = type_name(ttype)
    raw = np.asarray(data, dtype=np.uint8).reshape(rows, -1)
    if t == "Q8_0":
        b = raw.reshape(rows, cols // 32, 34)
        d = b[:, :, :2].copy().view(np.float16).astype(np.float32).reshape(rows, -1)
        q = b[:, :, 2:].copy().view(np.int8).reshape(rows, cols)
        return QuantTensor(8, torch.from_numpy(q), torch.from_numpy(d), None, 32)
    if t == "Q4_0":
        b = raw.reshape(rows, cols // 32, 18)
        d = b[:, :, :2].copy().view(np.float16).astype(np.float32).reshape(rows, -1)
        q4 = np.ascontiguousarray(b[:, :, 2:]).reshape(rows, cols // 2)
        return QuantTensor(4, torch.from_numpy(q4), torch.from_numpy(d), None, 32)
    if t == "Q5_0":
        return _q5_0(raw, rows, cols)
    if t == "Q4_K":
        return _q4_k(raw, rows, cols)
    if t == "Q6_K":
        return _q6_k(raw, rows, cols)
    raise unsupported(name, ttype)


def _q5_0(raw: np.ndarray, rows: int, cols: int) -> QuantTensor:
    nb = rows * (cols // 32)
    b = raw.reshape(nb, 22)
    d = b[:, :2].copy().view(np.float16).astype(np.float32).reshape(rows, -1)
    qh = b[:, 2:6].copy().view(np.uint32).reshape(nb, 1) >> np.arange(32, dtype=np.uint32)
    # 16 bytes: elements 0-15 in the low nibbles, 16-31 in the high ones.
    lo = b[:, 6:].reshape(nb, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)
    q = (lo & 0x0F).reshape(nb, 32) | ((qh & 1).astype(np.uint8) << 4)  # 0..31
    scales = torch.from_numpy(np.ascontiguousarray(d))
    if cols % 64 == 0:
        # The 6-bit layout decodes (code - 32) * s: code q + 16 is Q5_0's (q - 16) * d,
        # 7 bits a weight in memory against the 8-bit layout's 9.
        codes = torch.from_numpy((q + 16).reshape(rows, cols))
        return QuantTensor(6, pack6(codes), scales, None, 32)
    q8 = (q.astype(np.int16) - 16).astype(np.int8).reshape(rows, cols)
    return QuantTensor(8, torch.from_numpy(q8), scales, None, 32)


def _q4_k(raw: np.ndarray, rows: int, cols: int) -> QuantTensor:
    from gguf.quants import Q4_K

    nb = rows * (cols // QK_K)
    b = raw.reshape(nb, 144)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32).reshape(rows, -1)
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(rows, -1)
    sc, m = Q4_K.get_scale_min(b[:, 4:16].copy())
    scales = sc.reshape(rows, -1)  # [rows, cols / 32], 6-bit values
    mins = m.reshape(rows, -1)
    # 4 runs of 32 bytes per block: low nibbles are sub-block 2j, high nibbles 2j + 1.
    qs = b[:, 16:].reshape(nb, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(nb, 8, 32)
    # Ours: per 32 elements, byte j = element j | element j + 16 << 4.
    out = (q[:, :, :16] | (q[:, :, 16:] << 4)).reshape(rows, cols // 2)
    return QuantTensor(4, torch.from_numpy(np.ascontiguousarray(out)),
                       torch.from_numpy(np.ascontiguousarray(scales)),
                       torch.from_numpy(np.ascontiguousarray(mins)), 32,
                       torch.from_numpy(d), torch.from_numpy(dmin))


def _q6_k(raw: np.ndarray, rows: int, cols: int) -> QuantTensor:
    nb = rows * (cols // QK_K)
    b = raw.reshape(nb, 210)
    ql, qh = b[:, :128], b[:, 128:192]
    scales = b[:, 192:208].copy().view(np.int8).reshape(rows, -1)  # [rows, cols / 16]
    d = b[:, 208:210].copy().view(np.float16).reshape(rows, -1)
    lo = ql.reshape(nb, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    low = (lo & 0x0F).reshape(nb, 2, 4, 32)
    hi = qh.reshape(nb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    high = (hi & 0x03).reshape(nb, 2, 4, 32)
    q = (low | (high << 4)).reshape(rows, cols)  # codes 0..63, natural order
    return QuantTensor(6, pack6(torch.from_numpy(np.ascontiguousarray(q))),
                       torch.from_numpy(np.ascontiguousarray(scales)), None, 16,
                       torch.from_numpy(d))


def permute_rows(t: QuantTensor, index: torch.Tensor) -> QuantTensor:
    """``t`` with its output rows reordered: row i of the result is row ``index[i]``."""
    return t.rows(index)
