"""Mixtral: Mistral's attention (Llama's, with its optional sliding window) and a
top-k mixture of experts in every layer (``block_sparse_moe``: the top-k weights always
renormalised and kept in float32, experts named ``w1`` / ``w3`` / ``w2``)."""

from __future__ import annotations

from iterserve.model.model_config import ModelConfig
from iterserve.model.models.base import DecoderModel
from iterserve.model.models.moe_lm import MoECausalLM, MoEDecoderLayer


def _layer(cfg: ModelConfig, layer_idx: int) -> MoEDecoderLayer:
    return MoEDecoderLayer(cfg, layer_idx, style="mixtral")


class MixtralForCausalLM(MoECausalLM):
    moe_prefix = "block_sparse_moe"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, DecoderModel(cfg, _layer))
