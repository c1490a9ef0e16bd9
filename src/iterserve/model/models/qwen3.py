"""Qwen3 (dense): Llama's layer with a per-head RMSNorm on q and k before RoPE, no
q/k/v bias, ``head_dim`` from the config (not hidden / heads). Few-row decode steps run
on the C++ decoder, as Llama's do (``llama.fused_decoder_tensors``)."""

from __future__ import annotations

from functools import partial

from iterserve.model.layers.norms import RMSNorm
from iterserve.model.model_config import ModelConfig
from iterserve.model.models.base import CausalLM, DecoderLayer, DecoderModel, DecoderTensors
from iterserve.model.models.llama import fused_decoder_tensors


class Qwen3ForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        layer = partial(DecoderLayer, qk_norm=RMSNorm)
        super().__init__(cfg, DecoderModel(cfg, layer))

    def decoder_tensors(self) -> DecoderTensors | None:
        """The C++ decoder's tensors: Llama's, with the per-head q/k norms."""
        return fused_decoder_tensors(self)
