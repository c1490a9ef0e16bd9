"""The Llama family (Llama 2/3, Mistral, Qwen2): the plain pre-norm decoder of
``models/base.py`` (RMSNorm, SwiGLU, fused qkv with Qwen2's biases), plus the tensors
of the C++ one-token decoder (``cpu_ops.Decoder``), which implements this layer."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from iterserve.model.model_config import ModelConfig
from iterserve.model.models.base import CausalLM, DecoderLayer, DecoderModel


class LlamaForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, DecoderModel(cfg, DecoderLayer))

    def decoder_tensors(self) -> tuple[list[torch.Tensor], list[int]] | None:
        """The tensors and dimensions ``cpu_ops.Decoder`` takes, in its order: every
        projection's weight row-major (the single-row kernel's layout; made so here if
        the load-time choice picked another), a missing bias as an empty tensor. None
        when those row-major copies would take more than the extra weight memory
        ``linear.PACKED_WEIGHTS_MAX_BYTES`` allows (large models keep the torch path),
        or when the layer is not the one it implements (a sliding window: the C++
        decoder attends to everything; partial rotary; another activation).
        The projection weights are moved into transparent huge pages (``hugepages``)."""
        from iterserve.model import hugepages
        from iterserve.model.linear import PACKED_WEIGHTS_MAX_BYTES, Linear, set_gemv_mode

        cfg = self.config
        if (cfg.sliding_window is not None or cfg.rotary_dim != cfg.head_dim
                or cfg.hidden_act not in ("silu", "swish")):
            return None
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        extra = sum(
            m.weight.numel() * m.weight.element_size()
            for m in linears
            if m.gemv_mode != "cpp" and not m.weight.is_contiguous()
        )
        if extra > PACKED_WEIGHTS_MAX_BYTES:
            return None
        none = torch.empty(0, dtype=self.lm_head.weight.dtype)

        def lin(m: Linear) -> list[torch.Tensor]:
            if m.gemv_mode != "cpp":
                set_gemv_mode(m, "cpp", 1)  # single rows take the C++ path from now on
            gw = m.gemv_weight
            w = gw if m.gemv_mode == "cpp" and gw is not None else m.weight.detach().contiguous()
            # The decoder streams these every step: move them into huge pages, in
            # place of the layer's own copy (the parameter itself when it is the same
            # row-major storage), so memory is not doubled.
            h = hugepages.copy(w)
            if h is not w:
                if m.weight.is_contiguous() and w.data_ptr() == m.weight.data_ptr():
                    m.weight.data = h
                if m.gemv_mode == "cpp":
                    m.gemv_weight = h
            return [h, none if m.bias is None else m.bias.detach()]

        def w(norm: nn.Module) -> torch.Tensor:
            return cast(torch.Tensor, norm.weight).detach()

        m = self.model
        tensors = [m.embed_tokens.weight.detach(), w(m.norm), *lin(self.lm_head)]
        tensors.append(m.inv_freq)
        for layer in m.layers:
            assert isinstance(layer, DecoderLayer)
            a, mlp = layer.self_attn, layer.mlp
            tensors += [w(layer.input_layernorm), *lin(a.qkv_proj), *lin(a.o_proj)]
            tensors += [w(layer.post_attention_layernorm), *lin(mlp.gate_up_proj)]
            tensors += lin(mlp.down_proj)
        dims = [cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                cfg.intermediate_size, cfg.vocab_size]
        return tensors, dims


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama's layer; its sliding window (v0.1) comes from the config."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama's layer with q/k/v biases (``ModelConfig.attention_bias``)."""
