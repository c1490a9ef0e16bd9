"""Phi-3 (and Phi-3.5 / Phi-4-mini): Llama's layer, but the checkpoints store q/k/v and
gate/up already fused (``qkv_proj``, ``gate_up_proj``: loaded as they are), RoPE with
longrope scaling (short and long factors, the attention factor) and, where the config
says so, partial rotary; a sliding window over every layer when set."""

from __future__ import annotations

from iterserve.model.model_config import ModelConfig
from iterserve.model.models.base import CausalLM, DecoderLayer, DecoderModel


class Phi3ForCausalLM(CausalLM):
    stacked_params = ()  # the checkpoint's names are our fused ones

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, DecoderModel(cfg, DecoderLayer))
