"""How the roofline prices a model's weights by their storage format.

A step reads every dense weight once (and the experts its tokens pick), so the bytes a
weight takes in memory, its scales and mins included, set the memory-bound part of a
step: ``WeightFormat.bytes_per_weight``. A quantized weight is also decoded on the way
into the product: ``dequant_ops`` vector operations per weight per step (unpack, offset,
convert, scale), priced at the hardware's vector (non-tensor-core) throughput. The
activations stay in the float dtype, so FLOPs and the KV cache do not change.

The formats are the ones the runner loads (docs/quantization.md): GGUF block types as
llama.cpp lays them out, ours quantized at load (``int8``: a scale per output channel;
``int4``: a scale and a min per group), and compressed-tensors' W4A16 / W8A8.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class WeightFormat:
    """One weight storage format: bytes per weight in memory (scales and mins included)
    and the vector operations that decode one weight per step (0 for a float dtype)."""

    name: str
    bytes_per_weight: float
    dequant_ops: float = 0.0

    def __post_init__(self) -> None:
        if not self.bytes_per_weight > 0 or self.dequant_ops < 0:
            raise ValueError(f"weight format {self.name!r}: bytes_per_weight must be > 0 and "
                             f"dequant_ops >= 0")

    @property
    def is_quantized(self) -> bool:
        return self.dequant_ops > 0


# Block sizes as the formats define them: Q8_0 is 32 int8 + an fp16 scale (34 bytes per
# 32); Q4_0 32 nibbles + an fp16 scale (18/32); Q4_K a 256-weight super-block of nibbles,
# 6-bit scales and mins, and two fp16 bases (144/256); Q6_K 256 6-bit values, int8
# scales per 16 and an fp16 base (210/256). Q4_K_M mixes Q4_K with Q6_K (llama.cpp
# quotes 4.89 bits per weight for a 7B model). The operation counts are the decode's:
# int -> float and a multiply (8-bit); a shift, a mask and an offset before them
# (4-bit); a sub-block scale (K types); a second plane of bits (Q6_K).
WEIGHT_FORMATS: dict[str, WeightFormat] = {
    "float32": WeightFormat("float32", 4.0),
    "bfloat16": WeightFormat("bfloat16", 2.0),
    "float16": WeightFormat("float16", 2.0),
    "q8_0": WeightFormat("q8_0", 34 / 32, 2.0),
    "q6_k": WeightFormat("q6_k", 210 / 256, 5.0),
    "q4_0": WeightFormat("q4_0", 18 / 32, 4.0),
    "q4_k": WeightFormat("q4_k", 144 / 256, 5.0),
    "q4_k_m": WeightFormat("q4_k_m", 4.89 / 8, 5.0),
    # Quantized at load: int8 with a float32 scale per output channel (negligible);
    # int4 with a float32 scale and min per group of 32 (``--quantization-group-size``).
    "int8": WeightFormat("int8", 1.0, 2.0),
    "int4": WeightFormat("int4", 0.5 + 8 / 32, 4.0),
    # compressed-tensors: W4A16 with an fp16 scale per 128; W8A8 / W8A16 per channel.
    "w4a16": WeightFormat("w4a16", 0.5 + 2 / 128, 4.0),
    "w8a8": WeightFormat("w8a8", 1.0, 2.0),
    "w8a16": WeightFormat("w8a16", 1.0, 2.0),
}
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
            "q4_k_s": "q4_k", "q6_k_m": "q6_k", "int4_w4a16": "w4a16", "int8_w8a8": "w8a8"}
# GGML tensor type names -> formats (the rest of a GGUF file's types are float or refused).
_GGML_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "Q8_0": "q8_0",
               "Q4_0": "q4_0", "Q4_K": "q4_k", "Q6_K": "q6_k"}


def get_weight_format(name: str, group_size: int | None = None) -> WeightFormat:
    """A format by name (``q4_k_m``, ``Q8_0``, ``int8``, ``int4``, ``w4a16``, ``bf16``, ...);
    ``group_size`` resizes ``int4``'s groups (a scale and a min per group)."""
    key = name.lower().replace("-", "_")
    key = _ALIASES.get(key, key)
    if key not in WEIGHT_FORMATS:
        raise ValueError(f"unknown quantization {name!r}; choose one of "
                         f"{', '.join(f for f in WEIGHT_FORMATS if WEIGHT_FORMATS[f].is_quantized)}")
    fmt = WEIGHT_FORMATS[key]
    if key == "int4" and group_size:
        fmt = WeightFormat("int4", 0.5 + 8 / group_size, fmt.dequant_ops)
    return fmt


def compressed_tensors_format(config: dict[str, Any]) -> WeightFormat | None:
    """The format a config.json's compressed-tensors ``quantization_config`` describes
    (None: not quantized): its weights' bits and group size."""
    q = config.get("quantization_config") or config.get("compression_config")
    if not q:
        return None
    groups = list((q.get("config_groups") or {}).values())
    w = (groups[0].get("weights") if groups else None) or {}
    bits = int(w.get("num_bits") or 8)
    group = w.get("group_size") if w.get("strategy") == "group" else None
    base = get_weight_format("w4a16" if bits == 4 else "w8a16")
    if not group:
        return base
    scale_bytes = 2 / int(group)  # an fp16 scale per group
    return WeightFormat(base.name, bits / 8 + scale_bytes, base.dequant_ops)


def gguf_weight_format(path: str | Path) -> tuple[dict[str, Any], WeightFormat]:
    """A GGUF file's Hugging Face style config and its weights' format: the mean bytes
    per weight over every tensor in the file (each in its own type, as a ``Q4_K_M`` file
    mixes Q4_K, Q6_K and others) and the decode cost of its most common quantized type."""
    from iterserve.model.quant.gguf_loader import GGUFFile

    f = GGUFFile(path)
    nbytes = 0
    weights = 0
    by_type: dict[str, int] = {}
    for t in f.reader.tensors:
        nbytes += int(t.n_bytes)
        weights += int(t.n_elements)
        by_type[t.tensor_type.name] = by_type.get(t.tensor_type.name, 0) + int(t.n_elements)
    if not weights:
        raise ValueError(f"{path}: a GGUF file without tensors")
    quant = [k for k in sorted(by_type, key=by_type.__getitem__, reverse=True)
             if k in _GGML_TYPES and WEIGHT_FORMATS[_GGML_TYPES[k]].is_quantized]
    ops = WEIGHT_FORMATS[_GGML_TYPES[quant[0]]].dequant_ops if quant else 0.0
    name = quant[0].lower() if quant else "float"
    cfg = f.hf_config()
    cfg.setdefault("_name_or_path", Path(path).stem)
    return cfg, WeightFormat(name, nbytes / weights, ops)


def read_hf_config(source: str | Path) -> dict[str, Any]:
    """config.json from a file or checkpoint directory."""
    p = Path(source)
    if p.is_dir():
        p = p / "config.json"
    return json.loads(p.read_text())
