"""The gated MLP (SwiGLU / GeGLU) with gate and up fused into one projection."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from iterserve.model.layers.norms import FUSED_DTYPES
from iterserve.model.linear import Linear


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# HF ``hidden_act`` / ``hidden_activation`` -> the gate's activation.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_tanh": _gelu_tanh,
}


# A long prefill runs the MLP this many rows at a time on the CPU: its intermediate
# activations (2 x intermediate_size per row, 80 MB for 2,048 Qwen2-0.5B rows in float32)
# are the step's largest allocation, and a GEMM of this many rows is as fast per row.
CHUNK_ROWS = 512


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``; ``gate_up_proj`` holds gate then up."""

    cpu_fused = False  # set by the runner where the C++ kernels run (see norms.py)

    def __init__(self, hidden_size: int, intermediate_size: int, *, bias: bool = False,
                 act: str = "silu") -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(
                f"unsupported hidden_act {act!r}; supported: {', '.join(sorted(ACTIVATIONS))}"
            )
        self.intermediate_size = intermediate_size
        self.act = ACTIVATIONS[act]
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0] if x.dim() == 2 else 0
        if rows > CHUNK_ROWS and x.device.type == "cpu" and not torch.compiler.is_compiling():
            return torch.cat([self._forward(c) for c in x.split(CHUNK_ROWS)])
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.cpu_fused and not torch.compiler.is_compiling() and self.act is F.silu
                and x.dtype in FUSED_DTYPES and x.dim() == 2):
            # One C++ pass (csrc/norm_act.cpp) instead of silu, a copy of the strided
            # gate, and mul.
            return self.down_proj(torch.ops.iterserve_cpu.silu_and_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate).mul_(up))
