"""RMSNorm in the two forms the supported families use.

With ``cpu_fused`` set (the runner sets it where the C++ kernels run), activations take
one C++ pass (``csrc/norm_act.cpp``) instead of torch's chain of small ops, and
``add_forward`` fuses the residual add before the norm into it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

HALF = (torch.bfloat16, torch.float16)
# The dtypes csrc/norm_act.cpp's one-pass kernels take.
FUSED_DTYPES = (torch.float32, *HALF)


class RMSNorm(nn.Module):
    """Llama's RMSNorm: ``w * normalize(x)``, the product in the input dtype."""

    gemma = False
    cpu_fused = False

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def _fused(self, x: torch.Tensor) -> bool:
        # Not under torch.compile: inductor fuses the torch ops itself, and the checks
        # here would add guards (recompiles) to every compiled norm.
        return (self.cpu_fused and not torch.compiler.is_compiling() and x.dtype in FUSED_DTYPES
                and self.weight.dtype == x.dtype and x.dim() in (2, 3) and x.stride(-1) == 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused(x):
            return torch.ops.iterserve_cpu.rms_norm(x, self.weight, self.eps, self.gemma)
        return self._torch_forward(x)

    def _torch_forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # One fused op; in float32 it equals transformers' formula bit for bit.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Half precision: transformers' op order (normalize in float32, cast, scale).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_forward(self, delta: torch.Tensor, residual: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(residual + delta, norm of it)``. The fused kernel adds into ``residual`` in
        place (inference only: nothing else holds a layer's input)."""
        if self._fused(delta) and delta.dim() == 2 and residual.is_contiguous() \
                and residual.shape == delta.shape and residual.dtype == delta.dtype:
            out = torch.ops.iterserve_cpu.add_rms_norm(delta, residual, self.weight, self.eps,
                                                       self.gemma)
            return residual, out
        residual = residual + delta
        return residual, self(residual)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the weight is stored as an offset from one, ``(1 + w)``, and the
    product is taken in float32 before the cast (transformers' Gemma op order)."""

    gemma = True

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__(hidden_size, eps)
        self.weight = nn.Parameter(torch.zeros(hidden_size))

    def _torch_forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)
