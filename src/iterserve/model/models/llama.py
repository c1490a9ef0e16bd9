"""The Llama family (Llama 2/3, Mistral, Qwen2): the plain pre-norm decoder of
``models/base.py`` (RMSNorm, SwiGLU, fused qkv with Qwen2's biases), plus the tensors
of the C++ one-token decoder (``cpu_ops.Decoder``), which implements this layer (and
Qwen3's, which adds per-head q/k RMSNorms: ``fused_decoder_tensors``)."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from iterserve.model.layers.norms import RMSNorm
from iterserve.model.model_config import ModelConfig
from iterserve.model.models.base import CausalLM, DecoderLayer, DecoderModel, DecoderTensors
from iterserve.model.quant.packed import QuantTensor


class LlamaForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, DecoderModel(cfg, DecoderLayer))

    def decoder_tensors(self) -> DecoderTensors | None:
        return fused_decoder_tensors(self)


def fused_decoder_tensors(lm: CausalLM) -> DecoderTensors | None:
    """The tensors and dimensions ``cpu_ops.Decoder`` takes for a model of
    ``base.DecoderLayer`` layers with RMSNorms (Llama's, and Qwen3's with per-head q/k
    norms), in its order: every projection's weight row-major (the single-row kernel's
    layout; made so here if the load-time choice picked another), a missing bias or
    q/k norm as an empty tensor. None when those row-major copies would take more than
    the extra weight memory ``linear.PACKED_WEIGHTS_MAX_BYTES`` allows (large models
    keep the torch path), or when the layer is not the one it implements (a sliding
    window: the C++ decoder attends to everything; partial rotary; another activation;
    another norm; RoPE with an attention factor or two factor sets).
    A quantized projection (or embedding) is an empty tensor in the list and its
    packed parts go in the third element, by their index in the list (``Decoder.
    set_quant``). The projection weights are moved into transparent huge pages
    (``hugepages``)."""
    from iterserve.model import hugepages
    from iterserve.model.linear import PACKED_WEIGHTS_MAX_BYTES, Linear, set_gemv_mode
    from iterserve.model.quant.packed import QuantEmbedding

    cfg = lm.config
    rope_type = (cfg.rope_scaling or {}).get("rope_type")
    if (cfg.sliding_window is not None or cfg.rotary_dim != cfg.head_dim
            or cfg.hidden_act not in ("silu", "swish") or rope_type in ("yarn", "longrope")):
        return None
    m = lm.model
    for layer in m.layers:
        if type(layer) is not DecoderLayer:  # a subclass (MoE) is another layer
            return None
        norms = [layer.input_layernorm, layer.post_attention_layernorm,
                 layer.self_attn.q_norm, layer.self_attn.k_norm]
        # Exactly RMSNorm (w * normalize(x)): Gemma's (1 + w) form is another formula.
        if any(n is not None and type(n) is not RMSNorm for n in norms):
            return None
    linears = [x for x in lm.modules() if isinstance(x, Linear)]
    extra = sum(
        x.weight.numel() * x.weight.element_size()
        for x in linears
        if x.quant is None and x.gemv_mode != "cpp" and not x.weight.is_contiguous()
    )
    if extra > PACKED_WEIGHTS_MAX_BYTES:
        return None
    none = torch.empty(0, dtype=lm.lm_head.weight.dtype)
    quant: list[tuple[int, list[torch.Tensor], list[int]]] = []
    tensors: list[torch.Tensor] = []

    def lin(x: Linear) -> list[torch.Tensor]:
        bias = none if x.bias is None else x.bias.detach()
        if x.quant is not None:
            parts = x.quant.parts
            quant.append((len(tensors), *quant_parts(parts, [x.quant.kernel(p) for p in parts])))
            return [none, bias]
        if x.gemv_mode != "cpp":
            set_gemv_mode(x, "cpp", 1)  # single rows take the C++ path from now on
        gw = x.gemv_weight
        w = gw if x.gemv_mode == "cpp" and gw is not None else x.weight.detach().contiguous()
        # The decoder streams these every step: move them into huge pages, in
        # place of the layer's own copy (the parameter itself when it is the same
        # row-major storage), so memory is not doubled.
        h = hugepages.copy(w)
        if h is not w:
            if x.weight.is_contiguous() and w.data_ptr() == x.weight.data_ptr():
                x.weight.data = h
            if x.gemv_mode == "cpp":
                x.gemv_weight = h
        return [h, bias]

    def w(norm: nn.Module | None) -> torch.Tensor:
        return none if norm is None else cast(torch.Tensor, norm.weight).detach()

    if isinstance(m.embed_tokens, QuantEmbedding):
        quant.append((0, *quant_parts([m.embed_tokens.table], [0])))
        tensors += [none, w(m.norm)]
    else:
        tensors += [m.embed_tokens.weight.detach(), w(m.norm)]
    tensors += lin(lm.lm_head)
    tensors.append(m.inv_freq)
    layers: list[Any] = list(m.layers)  # exactly base.DecoderLayer (checked above)
    for layer in layers:
        a, mlp = layer.self_attn, layer.mlp
        # One at a time: lin() records its projection's index in the list.
        tensors.append(w(layer.input_layernorm))
        tensors += lin(a.qkv_proj)
        tensors += lin(a.o_proj)
        tensors.append(w(layer.post_attention_layernorm))
        tensors += lin(mlp.gate_up_proj)
        tensors += lin(mlp.down_proj)
        tensors += [w(a.q_norm), w(a.k_norm)]  # per head, before RoPE (Qwen3)
    dims = [cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.vocab_size]
    return tensors, dims, quant


def quant_parts(parts: list[QuantTensor], kernels: list[int]) -> tuple[list[torch.Tensor], list[int]]:
    """``Decoder.set_quant``'s arguments for these parts: five tensors and three ints each
    (an absent tensor empty). The packed weights move into huge pages (the decoder
    streams them every step), in place of their own copies."""
    from iterserve.model import hugepages

    none = torch.empty(0)
    tensors: list[torch.Tensor] = []
    meta: list[int] = []
    for p, kernel in zip(parts, kernels):
        p.qweight = hugepages.copy(p.qweight)
        tensors += [none if t is None else t for t in p.tensors()]
        meta += [p.bits, p.group, kernel]
    return tensors, meta


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama's layer; its sliding window (v0.1) comes from the config."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama's layer with q/k/v biases (``ModelConfig.attention_bias``)."""
