"""RMSNorm in the two forms the supported families use."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Llama's RMSNorm: ``w * normalize(x)``, the product in the input dtype."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # One fused op; in float32 it equals transformers' formula bit for bit.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Half precision: transformers' op order (normalize in float32, cast, scale).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is stored as an offset from one, ``(1 + w)``, and the
    product is taken in float32 before the cast (transformers' Gemma op order)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)
