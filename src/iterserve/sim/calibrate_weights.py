"""What a calibrated runner's weights are: their format and the bytes a step reads.

The calibration profile records them (``CostModel.quantization``, ``bytes_per_weight``,
``weight_bytes``, ``expert_bytes``) so that its weight-read terms say what they priced:
a MoE model's fitted ``expert_read`` is seconds per byte of expert weights times these
bytes. The bytes are counted on the loaded model, packed weights at their packed size
(scales and mins included), so they are exact whatever the format.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from iterserve.model.quant.packed import QuantTensor, QuantWeight

# The fused MoE layer's expert tensors (model/layers/moe.py): [experts, ...] each.
EXPERT_PARAMS = ("w13", "w2")


@dataclass(frozen=True, slots=True)
class WeightBytes:
    """A loaded model's weights: bytes of the dense part (what every step reads), of one
    expert in every MoE layer (0 for a dense model), and the mean bytes per weight."""

    dense_bytes: int
    expert_bytes: int
    bytes_per_weight: float


def _packed_size(obj: object) -> tuple[int, int]:
    """(bytes, weights) of a packed weight."""
    if isinstance(obj, QuantWeight):
        return obj.nbytes, obj.out_features * obj.in_features
    if isinstance(obj, QuantTensor):
        return obj.nbytes, obj.out_features * obj.in_features
    return 0, 0


def weight_bytes(model: nn.Module, num_experts: int = 0) -> WeightBytes:
    """Count ``model``'s weights: float parameters at their dtype, packed ones (a
    quantized ``Linear``'s ``quant``, a ``QuantEmbedding``'s table) at their packed
    size; a quantized projection's placeholder float weight (an expanded, zero-stride
    view) is not storage and is skipped."""
    dense = experts = weights = 0
    seen: set[int] = set()
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, QuantWeight | QuantTensor) and id(value) not in seen:
                seen.add(id(value))
                b, n = _packed_size(value)
                dense += b
                weights += n
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen or (p.dim() and 0 in p.stride()):
                continue
            seen.add(id(p))
            nbytes = p.numel() * p.element_size()
            weights += p.numel()
            if num_experts and name in EXPERT_PARAMS and p.dim() >= 3 and p.shape[0] == num_experts:
                experts += nbytes
            else:
                dense += nbytes
    if not weights:
        raise ValueError("the model has no weights to count")
    return WeightBytes(dense, experts // num_experts if num_experts else 0,
                       (dense + experts) / weights)


def quantization_name(model: str | None, quantization: str | None) -> str:
    """The runner's weight format as the simulator names it (``weight_formats``): the
    GGUF file's main type, a compressed-tensors checkpoint's W4A16 / W8A16, ``int8`` /
    ``int4`` quantized at load, or "" for float weights."""
    from iterserve.sim.weight_formats import (
        compressed_tensors_format,
        gguf_weight_format,
        read_hf_config,
    )

    if quantization in ("int8", "int4"):
        return quantization
    if not model:
        return ""
    p = Path(model)
    if p.is_file() and p.suffix.lower() == ".gguf":
        fmt = gguf_weight_format(p)[1]
        return fmt.name if fmt.is_quantized else ""
    if (p / "config.json").is_file():
        ct = compressed_tensors_format(read_hf_config(p))
        return ct.name if ct is not None else ""
    return ""


def runner_weights(runner: Any, model: str | None, quantization: str | None,
                   num_experts: int = 0) -> dict[str, Any]:
    """The profile's weight fields for a runner (``calibrate(weights=...)``), plus the
    expert bytes (``expert_bytes``) for the fit's expert column; {} when the runner has
    no torch model to count."""
    m = getattr(runner, "model", None)
    if not isinstance(m, nn.Module):
        return {}
    with torch.no_grad():
        wb = weight_bytes(m, num_experts)
    return {"quantization": quantization_name(model, quantization),
            "bytes_per_weight": wb.bytes_per_weight, "weight_bytes": float(wb.dense_bytes),
            "expert_bytes": float(wb.expert_bytes)}
