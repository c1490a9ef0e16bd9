"""Offline quantization for ``iterserve quantize``: the engine's seam onto the model's
compressed-tensors writer, so entrypoints never reach into ``model`` directly."""

from __future__ import annotations

from pathlib import Path


def write_quantized_checkpoint(model: Path, output: Path, quantization: str,
                               group_size: int) -> int:
    """Quantize ``model``'s projections and write a compressed-tensors checkpoint to
    ``output``; returns how many projections were quantized (ValueError on bad input)."""
    from iterserve.model.quant.compressed_tensors import write_checkpoint

    return write_checkpoint(model, output, quantization, group_size)
