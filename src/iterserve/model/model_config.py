"""The shape of a model, read from a Hugging Face ``config.json``.

No torch here: the simulator's roofline preset and the KV sizing arithmetic
consume ``ModelConfig`` without paying for a torch import.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# architectures[0] in config.json -> our implementation's family name.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}

# rope_type values we implement (model/llama.py: rope_frequencies).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(slots=True)
class ModelConfig:
    """Everything the runner, the KV sizing and a roofline need to know about a model."""

    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # rope_type plus its parameters (factor, low_freq_factor, ...); None: plain RoPE.
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    # Mistral v0.1 style sliding window; None when every layer attends to everything.
    sliding_window: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    torch_dtype: str | None = None  # the checkpoint's dtype ("bfloat16", ...)
    model_path: str = ""

    @property
    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        q = self.num_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h
        if self.attention_bias:
            attn += q + 2 * kv
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h
        emb = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.num_layers * per_layer + emb + head + h

    @property
    def num_non_embedding_params(self) -> int:
        """Parameters a token's forward pass multiplies through (the lm_head included).

        ``2 * num_non_embedding_params`` is the usual FLOPs-per-token estimate.
        """
        return self.num_params - self.vocab_size * self.hidden_size * (
            0 if self.tie_word_embeddings else 1
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def kv_bytes_per_block(self, block_size: int, dtype_bytes: int) -> int:
        return block_size * self.kv_bytes_per_token(dtype_bytes)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], model_path: str = "") -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported model architecture {archs or cfg.get('model_type')!r} in "
                f"{model_path or 'config.json'}; supported: "
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        rope_theta, rope_scaling = _rope(cfg)
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else list(eos))
        sliding_window = cfg.get("sliding_window")
        if family == "qwen2" and not cfg.get("use_sliding_window", False):
            sliding_window = None
        return cls(
            architecture=arch,
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=hidden,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            # Qwen2 always has q/k/v biases; Llama/Mistral only when attention_bias says so.
            attention_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            sliding_window=int(sliding_window) if sliding_window else None,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            model_path=model_path,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        with open(path / "config.json") as f:
            return cls.from_hf_config(json.load(f), model_path=str(path))


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling) from either transformers 4 (rope_theta + rope_scaling) or
    transformers 5 (rope_parameters) config layouts."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" not in params and params:
        # Per-layer-type dict (e.g. {"full_attention": {...}}): take the first.
        params = next(iter(params.values()))
    scaling = cfg.get("rope_scaling") or (dict(params) if isinstance(params, dict) else None)
    theta = float(
        (params or {}).get("rope_theta") or cfg.get("rope_theta") or 10000.0
    )
    if scaling is not None:
        scaling = dict(scaling)
        rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
        scaling["rope_type"] = rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope_scaling type {rope_type!r}; supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if rope_type == "default":
            scaling = None
    return theta, scaling
