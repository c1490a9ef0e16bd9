"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k
RMSNorms before RoPE) and, on the layers ``mlp_only_layers`` / ``decoder_sparse_step``
leave sparse, a top-k mixture of experts (``norm_topk_prob``: the top-k weights
renormalised) in place of the dense MLP."""

from __future__ import annotations

from iterserve.model.layers.norms import RMSNorm
from iterserve.model.model_config import ModelConfig
from iterserve.model.models.base import DecoderModel
from iterserve.model.models.moe_lm import MoECausalLM, MoEDecoderLayer


def _layer(cfg: ModelConfig, layer_idx: int) -> MoEDecoderLayer:
    return MoEDecoderLayer(cfg, layer_idx, qk_norm=RMSNorm, style="qwen")


class Qwen3MoeForCausalLM(MoECausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, DecoderModel(cfg, _layer))
