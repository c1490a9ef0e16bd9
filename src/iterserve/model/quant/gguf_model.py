"""A GGUF file's tensors into a built model: float tensors through the model's own
``load_weights``, quantized projections packed onto its ``Linear`` layers (stacked in
the fused q/k/v and gate/up order the model declares), and a quantized token embedding
kept packed (``QuantEmbedding``: a Qwen2-0.5B's float32 table alone is 545 MB)."""

from __future__ import annotations

from typing import Any

from iterserve.model.quant import ggml
from iterserve.model.quant.attach import QuantAttacher
from iterserve.model.quant.gguf_loader import GGUFFile, check_size
from iterserve.model.quant.packed import QuantEmbedding, QuantTensor


def load_gguf_weights(model: Any, gf: GGUFFile, hf_cfg: dict[str, Any]) -> set[str]:
    """Load every tensor of ``gf`` into ``model`` (an nn.Module with the families'
    ``load_weights``); returns the HF names loaded."""
    attacher = QuantAttacher(model, gf.path)
    loaded: set[str] = set()
    embd = gf.tensors.get("token_embd.weight")
    embd_packed = None
    if embd is not None and ggml.type_name(embd.tensor_type) in ggml.QUANT_TYPES:
        rows, cols = (int(d) for d in reversed(embd.shape))
        check_size(gf.path, embd, (rows, cols))
        embd_packed = ggml.packed(embd.data, embd.tensor_type, rows, cols, embd.name)
        gf.release(embd)
    for hf, value in gf.iter_tensors(hf_cfg, skip={"token_embd.weight"} if embd_packed else None):
        if isinstance(value, QuantTensor):
            attacher.add(hf, value)
            loaded.add(hf)
        else:
            loaded |= attacher.load_weights([(hf, value)])
    if embd_packed is not None:
        inner = model.model
        dtype = inner.embed_tokens.weight.dtype
        inner.embed_tokens = QuantEmbedding(embd_packed, dtype)
        loaded.add("model.embed_tokens.weight")
        if hf_cfg["tie_word_embeddings"]:
            # As llama.cpp does: the tied head multiplies by the packed embedding.
            attacher.add("lm_head.weight", embd_packed)
    attacher.finish()
    return loaded
