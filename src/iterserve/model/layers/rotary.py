"""Rotary position embeddings: inverse frequencies with the ``rope_scaling`` variants
(linear, llama3, Phi-3's longrope), partial rotary, and cos/sin once per step.

Longrope has two frequency sets: the short factors within the pretraining length
(``original_max_position_embeddings``), the long ones beyond it. transformers picks by
the sequence's length, so a request whose prompt is longer than that length runs on
the long set throughout. Here the choice is made per request by the input builder,
which marks a long request's positions by adding ``LONG_ROPE_OFFSET`` (vLLM's
offset trick): the model's signature stays ``(input_ids, positions)``. (A request that
crosses the length while decoding keeps the short set; transformers recomputes its
cache with the long one at that point.) Since the two sets give the same tokens
different K/V, the prefix cache keeps them apart: a long request's blocks are salted
(``OutputProcessor``'s ``long_rope_after``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from iterserve.model.model_config import longrope_original_length

# Added to the positions of a request that runs on longrope's long factors.
LONG_ROPE_OFFSET = 1 << 40


def rope_inv_freq(
    dim: int, theta: float, scaling: dict[str, Any] | None, *, long: bool = False
) -> torch.Tensor:
    """Inverse frequencies [dim // 2] for a rotary dimension ``dim``, with the
    rope_scaling variant applied (``long``: longrope's long factors)."""
    # On the CPU explicitly: models are built under a meta-device context.
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (theta**exponent)
    if not scaling:
        return inv_freq
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        # Llama 3.1: long wavelengths slowed by `factor`, short kept, a smooth ramp between.
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    if rope_type == "longrope":
        factors = scaling["long_factor" if long else "short_factor"]
        ext = torch.tensor(factors, dtype=torch.float32, device="cpu")
        if ext.numel() != dim // 2:
            raise ValueError(
                f"rope_scaling {'long' if long else 'short'}_factor has {ext.numel()} "
                f"entries, expected {dim // 2}"
            )
        return 1.0 / (ext * theta**exponent)
    raise ValueError(f"unsupported rope_type {rope_type!r}")


def rope_attention_factor(scaling: dict[str, Any] | None, max_position_embeddings: int) -> float:
    """The factor cos and sin are scaled by (longrope's attention factor; else 1)."""
    if not scaling or scaling["rope_type"] != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or max_position_embeddings / original
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(original))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """transformers' ``x * cos + rotate_half(x) * sin`` in three ops: rotate_half(x) is
    roll(x, D/2) with the first half negated, and the sign is folded into ``sin_signed``.
    A rotary dimension below the head's (partial rotary) leaves the rest unrotated."""
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return torch.addcmul(x * cos, x.roll(rd // 2, dims=-1), sin_signed)
    rot = x[..., :rd]
    rot = torch.addcmul(rot * cos, rot.roll(rd // 2, dims=-1), sin_signed)
    return torch.cat((rot, x[..., rd:]), dim=-1)


class RotaryEmbedding(nn.Module):
    """cos/sin ``[T, 1, rotary_dim]`` for a step's positions (sin sign-folded)."""

    inv_freq: torch.Tensor  # buffers (not parameters): the inverse frequencies
    long_inv_freq: torch.Tensor

    def __init__(self, rotary_dim: int, theta: float, scaling: dict[str, Any] | None,
                 max_position_embeddings: int) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        self.theta = theta
        self.scaling = scaling
        self.attention_scaling = rope_attention_factor(scaling, max_position_embeddings)
        self.longrope = longrope_original_length(scaling) is not None
        self.reset_buffers(torch.device("cpu"))

    def reset_buffers(self, device: torch.device) -> None:
        """(Re)compute the frequencies on ``device`` (after a meta-device build)."""
        inv = rope_inv_freq(self.rotary_dim, self.theta, self.scaling).to(device)
        self.register_buffer("inv_freq", inv, persistent=False)
        if self.longrope:
            long = rope_inv_freq(self.rotary_dim, self.theta, self.scaling, long=True)
            self.register_buffer("long_inv_freq", long.to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # float32 like transformers, then cast.
        if self.longrope:
            long = positions >= LONG_ROPE_OFFSET
            pos = (positions - long.long() * LONG_ROPE_OFFSET).float()
            inv = torch.where(long[:, None], self.long_inv_freq[None, :], self.inv_freq[None, :])
            freqs = pos[:, None] * inv.float()
        else:
            freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        cos = freqs.cos()
        sin = freqs.sin()
        if self.attention_scaling != 1.0:
            cos = cos * self.attention_scaling
            sin = sin * self.attention_scaling
        cos = torch.cat((cos, cos), dim=-1).to(dtype)[:, None, :]
        sin = torch.cat((-sin, sin), dim=-1).to(dtype)[:, None, :]  # sign of rotate_half
        return cos, sin
