"""The model families: one module per family, built on ``model/layers``.

``MODEL_REGISTRY`` maps a Hugging Face architecture name (``architectures[0]`` in
config.json) to the module and class implementing it; modules load on first use, so
importing the registry costs no torch import (the simulator reads it through
``ModelConfig``). docs/models.md lists the same architectures (a test checks it).
"""

from __future__ import annotations

import importlib
from typing import Any

# HF architecture -> (module under iterserve.model.models, class name)
MODEL_REGISTRY: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Gemma2ForCausalLM": ("gemma3", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def get_model_class(architecture: str) -> Any:
    """The class implementing ``architecture``; a clear error listing the supported ones."""
    entry = MODEL_REGISTRY.get(architecture)
    if entry is None:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: "
            f"{', '.join(supported_architectures())}"
        )
    module, cls = entry
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)
