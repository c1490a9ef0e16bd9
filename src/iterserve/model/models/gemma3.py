"""Gemma 2 and Gemma 3 (text): GeGLU MLP, ``(1 + w)`` RMSNorms before and after both
attention and MLP, the embedding scaled by sqrt(hidden), queries scaled by
``query_pre_attn_scalar**-0.5``, sliding-window and global layers interleaved
(``layer_types``), final-logit soft-capping (``CausalLM.compute_logits``). Gemma 2
soft-caps attention scores too; Gemma 3 instead normalizes q and k per head and gives
its local layers their own RoPE base (``rope_local_base_freq``)."""

from __future__ import annotations

import torch
from torch import nn

from iterserve.model.layers.attention import QKVAttention, RopeTable
from iterserve.model.layers.mlp import GatedMLP
from iterserve.model.layers.norms import GemmaRMSNorm
from iterserve.model.layers.rotary import RotaryEmbedding
from iterserve.model.model_config import ModelConfig
from iterserve.model.models.base import CausalLM, DecoderModel


class GemmaDecoderLayer(nn.Module):
    """``x + norm(attn(norm(x)))``, then ``x + norm(mlp(norm(x)))``."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        local = cfg.layer_sliding_window(layer_idx) is not None and cfg.rope_local_theta
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = QKVAttention(
            cfg, layer_idx, qk_norm=GemmaRMSNorm if cfg.family == "gemma3" else None,
            rope_key="local" if local else "default",
        )
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = GatedMLP(h, cfg.intermediate_size, act=cfg.hidden_act)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, x: torch.Tensor, rope: RopeTable) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope))
        return x.add_(self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))))


def _gemma_model(cfg: ModelConfig) -> DecoderModel:
    rotary = {"default": RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling,
                                         cfg.max_position_embeddings)}
    if cfg.rope_local_theta:
        rotary["local"] = RotaryEmbedding(cfg.rotary_dim, cfg.rope_local_theta,
                                          cfg.rope_local_scaling, cfg.max_position_embeddings)
    return DecoderModel(cfg, GemmaDecoderLayer, norm=GemmaRMSNorm, rotary=rotary,
                        embed_scale=True)


class Gemma3ForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, _gemma_model(cfg))


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2: the same layer without q/k norms, one RoPE, attention soft-capping."""
