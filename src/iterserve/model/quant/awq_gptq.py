"""AWQ (GEMM packing) and GPTQ 4-bit checkpoints read into the 4-bit layout of ``packed``.

Both store a projection as int32 words of eight 4-bit values (value ``i`` at bits
``4i``), per-group float16 ``scales [in/group, out]`` and packed ``qzeros
[in/group, out/8]``; ``w[o, i] = (q - z) * s`` of the input's group:

- AWQ (``version: gemm``): ``qweight [in, out/8]`` packed along the outputs in AWQ's
  order (nibble ``i`` holds output ``8c + [0, 2, 4, 6, 1, 3, 5, 7][i]``), ``qzeros``
  likewise.
- GPTQ: ``qweight [in/8, out]`` packed along the inputs in order, ``qzeros`` along the
  outputs in order, stored as ``z - 1`` (``checkpoint_format`` ``gptq``; ``gptq_v2``
  stores ``z``); ``g_idx`` must be the plain ``i // group`` (``desc_act`` false).

Symmetric checkpoints (every zero 8) load without mins and keep their float16 scales.
"""

from __future__ import annotations

from typing import Any

import torch

from iterserve.model.quant.packed import QuantTensor, pack4

METHODS = ("awq", "gptq")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def check_config(q: dict[str, Any], source: object) -> None:
    method = q.get("quant_method")
    if q.get("bits", q.get("w_bit")) != 4:
        raise ValueError(f"{source}: {method} with {q.get('bits')} bits is not supported; "
                         "supported: 4")
    if method == "awq" and str(q.get("version", "gemm")).lower() != "gemm":
        raise ValueError(f"{source}: AWQ version {q.get('version')!r} is not supported; "
                         "supported: gemm")
    if method == "gptq":
        if q.get("desc_act"):
            raise ValueError(f"{source}: GPTQ with desc_act true (act-order) is not "
                             "supported; supported: desc_act false")
        fmt = q.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"{source}: GPTQ checkpoint_format {fmt!r} is not supported; "
                             "supported: gptq, gptq_v2")


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 words [..., n] -> their eight 4-bit values [..., n, 8] (value i at bits 4i)."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    return ((w[..., None] >> torch.arange(0, 32, 4, dtype=torch.int64)) & 0xF).to(torch.int16)


def _along_out(words: torch.Tensor, order: tuple[int, ...] | None) -> torch.Tensor:
    """[rows, out/8] words packed along the outputs -> [rows, out] values."""
    v = _nibbles(words)  # [rows, out/8, 8]: nibble i
    if order is not None:  # nibble i holds output 8c + order[i]: put each where it belongs
        inv = torch.argsort(torch.tensor(order))
        v = v[..., inv]
    return v.reshape(words.shape[0], -1)


def to_packed(prefix: str, get: Any, have: set[str], q: dict[str, Any]) -> QuantTensor | None:
    if f"{prefix}.qweight" not in have:
        return None
    method = q["quant_method"]
    qweight, qzeros = get(f"{prefix}.qweight"), get(f"{prefix}.qzeros")
    scales = get(f"{prefix}.scales")  # [groups, out]
    if method == "awq":
        u = _along_out(qweight, AWQ_ORDER)  # [in, out]
        z = _along_out(qzeros, AWQ_ORDER)  # [groups, out]
    else:
        u = _nibbles(qweight.t().contiguous()).reshape(qweight.shape[1], -1).t()  # [in, out]
        z = _along_out(qzeros, None)
        if q.get("checkpoint_format", "gptq") == "gptq":
            z = z + 1
        if f"{prefix}.g_idx" in have:
            g_idx = get(f"{prefix}.g_idx").to(torch.int64)
            group = u.shape[0] // scales.shape[0]
            if not torch.equal(g_idx, torch.arange(u.shape[0]) // group):
                raise ValueError(f"{prefix}: a g_idx that is not in order (act-order) is "
                                 "not supported")
    inp, out = u.shape
    groups = scales.shape[0]
    if inp % groups or out != scales.shape[1]:
        raise ValueError(f"{prefix}: scales of shape {tuple(scales.shape)} do not fit a "
                         f"[{inp}, {out}] weight")
    qw = pack4(u.t().contiguous().to(torch.uint8))
    st = scales.t().contiguous()
    if bool((z == 8).all()):
        return QuantTensor(4, qw, st if st.dtype == torch.float16 else st.float(), None,
                           inp // groups)
    sf = st.float()
    return QuantTensor(4, qw, sf, (sf * z.t().float()).contiguous(), inp // groups)


# --- writing, for tests and tools: the formats above from integer values ----------------


def _pack_along_out(v: torch.Tensor, order: tuple[int, ...] | None) -> torch.Tensor:
    rows, out = v.shape
    c = v.to(torch.int64).reshape(rows, out // 8, 8)
    if order is not None:
        c = c[..., list(order)]  # nibble i <- output 8c + order[i]
    word = (c << torch.arange(0, 32, 4, dtype=torch.int64)).sum(-1)
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)


def pack_awq(u: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight, qzeros) for values ``u [in, out]`` and zeros ``z [groups, out]``."""
    return _pack_along_out(u, AWQ_ORDER), _pack_along_out(z, AWQ_ORDER)


def pack_gptq(u: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight, qzeros) in GPTQ's v1 format (zeros stored minus one)."""
    return _pack_along_out(u.t().contiguous(), None).t().contiguous(), _pack_along_out(z - 1, None)
