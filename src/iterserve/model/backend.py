"""Which kernels the model runs on: the one place that decides, and says why.

Backends (``BackendConfig.backend``):

- ``torch``: plain torch ops (SDPA attention, torch/MKL/oneDNN matmuls). The
  reference: runs on any device and dtype, and every other backend falls back to it.
- ``cpp``: our C++ CPU kernels (``cpu_ops``, built on first use): a one-token step
  runs as one call to the C++ decoder, a lone decode's attention and single-row
  projections take C++ kernels; everything else is the torch path. CPU, float32 or
  bfloat16, AVX2/FMA and a C++ compiler.
- ``flash``: flash-attn's varlen kernel over the paged cache, one call for a whole
  step. CUDA with flash-attn installed, fp16/bf16, block size a multiple of 256.
  Written against flash-attn's API but never run on a GPU: the CPU suite does not
  exercise it, and choosing it logs a warning saying so.
- ``auto`` (default): ``cpp`` on CPU and ``flash`` on CUDA where they work, else ``torch``.

A backend asked for by name that cannot run here falls back to ``torch`` with a
warning; ``auto`` falls back quietly (one info line). Environment variables give
the defaults (``config.BackendConfig``; docs/configuration.md): ``ITERSERVE_BACKEND``,
``ITERSERVE_FUSED_DECODE=0`` (no C++ decoder), ``ITERSERVE_PACKED_WEIGHTS=0``,
``ITERSERVE_GEMV=plain|rows|cols|cpp``; ``ITERSERVE_CPU_OPS=0`` keeps the C++
kernels from being built at all.

Torch is imported only inside ``select_backend``: the config layer can import
``BackendConfig`` without it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from iterserve.config import BACKENDS, GEMV_CHOICES, BackendConfig

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# The settings live with every other setting (iterserve.config); re-exported here.
__all__ = [
    "BACKENDS", "GEMV_CHOICES", "BackendChoice", "BackendConfig", "cpp_kernels_usable",
    "log_choice", "select_backend",
]

FLASH_UNTESTED = (
    "the flash-attn (CUDA) attention path has never been run on a GPU: "
    "check its outputs against --backend torch before relying on it"
)


@dataclass(frozen=True, slots=True)
class BackendChoice:
    """What ``select_backend`` decided: the backend that runs, and why."""

    name: str  # torch | cpp | flash
    reason: str
    requested: str  # the config's backend

    @property
    def cpp_kernels(self) -> bool:
        return self.name == "cpp"

    @property
    def flash(self) -> bool:
        return self.name == "flash"


def cpp_kernels_usable(device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether our C++ CPU kernels can run a model of ``dtype`` on ``device`` (building
    them on first call), and if not, why."""
    import torch

    from iterserve.model import cpu_ops

    if device.type != "cpu":
        return False, f"the C++ kernels are CPU only (device {device.type})"
    if dtype not in (torch.float32, torch.bfloat16):
        return False, f"the C++ kernels take float32 or bfloat16, not {dtype}"
    if not cpu_ops.available():
        return False, f"C++ CPU kernels unavailable: {cpu_ops.unavailable_reason}"
    return True, "C++ CPU kernels"


def _flash_usable(device: torch.device, dtype: torch.dtype, block_size: int | None
                  ) -> tuple[bool, str]:
    from iterserve.model.attention import flash_attn_varlen_func, flash_available

    if flash_attn_varlen_func is None:
        return False, "flash-attn is not installed"
    if block_size is None:  # at model load: the block size is not needed yet
        return device.type == "cuda", "flash-attn varlen (CUDA)"
    if not flash_available(device, block_size, dtype):
        return False, ("flash-attn needs CUDA, fp16/bf16 and a block size that is a "
                       f"multiple of 256 (got {device.type}, {dtype}, {block_size})")
    return True, "flash-attn varlen (CUDA)"


def select_backend(config: BackendConfig, device: torch.device, dtype: torch.dtype,
                   block_size: int | None = None) -> BackendChoice:
    """The backend ``config`` gets on ``device`` for ``dtype`` (and the KV cache's
    ``block_size``, which flash-attn constrains; None at model load). Deterministic
    in its inputs, so the loader and the runner agree."""
    want = config.backend
    if want == "torch":
        return BackendChoice("torch", "requested", want)
    tries = [want] if want != "auto" else (["flash"] if device.type == "cuda" else ["cpp"])
    reasons = []
    for name in tries:
        ok, why = (cpp_kernels_usable(device, dtype) if name == "cpp"
                   else _flash_usable(device, dtype, block_size))
        if ok:
            return BackendChoice(name, why, want)
        reasons.append(why)
    return BackendChoice("torch", "; ".join(reasons) or "no faster backend here", want)


def log_choice(choice: BackendChoice) -> None:
    """One line for the log: what runs and why; a warning where a backend asked for
    by name fell back, or where the untested CUDA path was chosen."""
    if choice.flash:
        logger.warning("model backend: flash (%s); %s", choice.reason, FLASH_UNTESTED)
    elif choice.requested not in ("auto", choice.name):
        logger.warning("model backend: %s requested but %s; using torch",
                       choice.requested, choice.reason)
    else:
        logger.info("model backend: %s (%s)", choice.name, choice.reason)
