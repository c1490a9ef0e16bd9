"""A GGUF file's tensors into a built model: float tensors through the model's own
``load_weights``, quantized projections packed onto its ``Linear`` layers (stacked in
the fused q/k/v and gate/up order the model declares), and a quantized token embedding
kept packed (``QuantEmbedding``: a Qwen2-0.5B's float32 table alone is 545 MB)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from iterserve.model.linear import Linear, set_quant
from iterserve.model.quant import ggml
from iterserve.model.quant.gguf_loader import GGUFFile, check_size
from iterserve.model.quant.packed import QuantEmbedding, QuantTensor, QuantWeight

logger = logging.getLogger(__name__)


def _fused_target(model: nn.Module, hf: str) -> tuple[str, int, int]:
    """(the Linear's module name, this shard's position in it, its number of shards)."""
    stacked = getattr(type(model), "_STACKED", ())
    for frag, ours, _ in stacked:
        if f".{frag}." in hf:
            shards = [f for f, o, _ in stacked if o == ours]
            return hf.replace(frag, ours).rsplit(".", 1)[0], shards.index(frag), len(shards)
    return hf.rsplit(".", 1)[0], 0, 1


def load_gguf_weights(model: Any, gf: GGUFFile, hf_cfg: dict[str, Any]) -> set[str]:
    """Load every tensor of ``gf`` into ``model`` (an nn.Module with the families'
    ``load_weights``); returns the HF names loaded."""
    modules = dict(model.named_modules())
    quant: dict[str, list[tuple[int, str, QuantTensor]]] = {}
    shards: dict[str, int] = {}
    loaded: set[str] = set()
    load_weights: Callable[[list[tuple[str, torch.Tensor]]], set[str]] = model.load_weights
    embd = gf.tensors.get("token_embd.weight")
    embd_packed = None
    if embd is not None and ggml.type_name(embd.tensor_type) in ggml.QUANT_TYPES:
        rows, cols = (int(d) for d in reversed(embd.shape))
        check_size(gf.path, embd, (rows, cols))
        embd_packed = ggml.packed(embd.data, embd.tensor_type, rows, cols, embd.name)
    for hf, value in gf.iter_tensors(hf_cfg, skip={"token_embd.weight"} if embd_packed else None):
        if isinstance(value, QuantTensor):
            target, pos, n = _fused_target(model, hf)
            if not isinstance(modules.get(target), Linear):
                raise ValueError(f"{gf.path}: tensor for {hf!r} has no projection to go to")
            quant.setdefault(target, []).append((pos, hf, value))
            shards[target] = n
            loaded.add(hf)
        else:
            loaded |= load_weights([(hf, value)])
    if embd_packed is not None:
        inner = model.model
        dtype = inner.embed_tokens.weight.dtype
        inner.embed_tokens = QuantEmbedding(embd_packed, dtype)
        loaded.add("model.embed_tokens.weight")
        if hf_cfg["tie_word_embeddings"]:
            # As llama.cpp does: the tied head multiplies by the packed embedding.
            quant["lm_head"] = [(0, "lm_head.weight", embd_packed)]
            shards["lm_head"] = 1
    for target, parts in quant.items():
        layer = modules[target]
        assert isinstance(layer, Linear)
        parts.sort(key=lambda p: p[0])
        if len(parts) == shards[target]:
            set_quant(layer, QuantWeight([p for _, _, p in parts]))
        else:  # some shards stored as floats: the whole projection runs in floats
            logger.info("%s: quantized and float shards mixed; dequantized", target)
            with torch.no_grad():
                for _, hf, p in parts:
                    load_weights([(hf, p.dequantize())])
    return loaded
