"""``--quantization int8 / int4``: a float checkpoint's projections quantized at load
into the packed layouts (``packed``), run by the same kernels as a GGUF file's.

int8: symmetric, one scale per output channel. int4: asymmetric (a scale and a min)
per ``group`` weights of a row. The vocabulary head is kept at int8 per channel under
either (as llama.cpp keeps its output tensor at 6 bits or more: the logits are where
4-bit error shows most). A layer whose shape the layout cannot take stays float.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from iterserve.model.linear import Linear, set_quant
from iterserve.model.quant.packed import QuantWeight, quantize_int4, quantize_int8

logger = logging.getLogger(__name__)

METHODS = ("int8", "int4")


def quantize_model(model: nn.Module, method: str, group: int = 32) -> int:
    """Quantize every projection of ``model`` in place; returns how many were."""
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(METHODS)}, got {method!r}")
    done = 0
    with torch.no_grad():
        for name, m in model.named_modules():
            if not isinstance(m, Linear) or m.quant is not None:
                continue
            w = m.weight.detach()
            head = name == "lm_head"
            if method == "int8" or head:
                if m.in_features % 16:
                    logger.info("%s stays float: in_features %d is not a multiple of 16",
                                name, m.in_features)
                    continue
                qt = quantize_int8(w)
            else:
                if m.in_features % group:
                    logger.info("%s stays float: in_features %d is not a multiple of the "
                                "group %d", name, m.in_features, group)
                    continue
                qt = quantize_int4(w, group)
            set_quant(m, QuantWeight([qt]))
            done += 1
    return done
