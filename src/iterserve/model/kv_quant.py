"""The 8-bit KV cache (``--kv-cache-dtype int8 | fp8 | fp8_e4m3``): how a K/V row is
stored and read back.

Each cached row (one token's K or V for one KV head, ``head_dim`` values) is stored
as 8-bit values and one bfloat16 scale computed from that row as it is written:
``scale = max|x| / qmax`` (127 for int8, symmetric; 448, e4m3's largest finite value,
for fp8), ``q = x / scale`` rounded (int8) or converted (e4m3). A row never waits for
other tokens to pick its scale (no calibration pass, no requantising a half-full
block), every row uses its whole 8-bit range whatever its magnitude, and the kernels
apply one multiply per score (K) and per softmax weight (V). vLLM's per-tensor scales
(``--calculate-kv-scales``) need a calibration pass and lose precision on rows much
smaller than the tensor's largest. The scales live beside the cache in a
``[layers, 2, blocks, block_size, kv_heads]`` tensor indexed like it, so swap copies
and prefix-cache sharing move them with their blocks.
"""

from __future__ import annotations

import torch

from iterserve.config import kv_cache_is_8bit

SCALE_DTYPE = torch.bfloat16
_TORCH_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
# A row of zeros gets this scale (so x / scale is 0, never NaN).
_MIN_SCALE = 1e-30


def cache_dtype_for(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype the KV pool is allocated in for ``--kv-cache-dtype``."""
    if kv_cache_is_8bit(cache_dtype):
        return _TORCH_DTYPES[cache_dtype]
    return model_dtype


def is_8bit(dtype: torch.dtype) -> bool:
    return dtype in _QMAX


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (8-bit values [..., D] in ``dtype``, bfloat16 scales [...])."""
    qmax = _QMAX[dtype]
    xf = x.float()
    scale = (xf.abs().amax(-1) / qmax).clamp_min_(_MIN_SCALE).to(SCALE_DTYPE)
    y = xf / scale.float().unsqueeze(-1)
    if dtype == torch.int8:
        return y.round_().clamp_(-qmax, qmax).to(torch.int8), scale
    return y.clamp_(-qmax, qmax).to(dtype), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of ``quantize_rows``: [..., D] in ``dtype``."""
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)


def write_rows(cache: torch.Tensor, scales: torch.Tensor, slot_mapping: torch.Tensor,
               x: torch.Tensor) -> None:
    """x [T, KVH, D] quantized into its slots of one pool: ``cache`` [blocks, block_size,
    KVH, D] (8-bit) and ``scales`` [blocks, block_size, KVH]."""
    qx, sx = quantize_rows(x, cache.dtype)
    as_bytes(cache).view(-1, *x.shape[1:]).index_copy_(0, slot_mapping, as_bytes(qx))
    scales.view(-1, x.shape[1]).index_copy_(0, slot_mapping, sx)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of an 8-bit tensor (index_copy_ has no float8 kernel on CPU)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
