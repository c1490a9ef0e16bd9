"""The shape of a model, read from a Hugging Face ``config.json``.

No torch here: the simulator's roofline preset and the KV sizing arithmetic
consume ``ModelConfig`` without paying for a torch import.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from iterserve.config import kv_row_bytes
from iterserve.model.models import MODEL_REGISTRY

# architectures[0] in config.json -> our implementation's family name
# ("Qwen3ForCausalLM" -> "qwen3"); the registry (model/models/) is the one list.
SUPPORTED_ARCHITECTURES = {
    arch: arch.removesuffix("ForCausalLM").lower() for arch in MODEL_REGISTRY
}

# rope_type values we implement (model/layers/rotary.py: rope_inv_freq).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


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
    # Sliding-window attention: each query sees the last ``sliding_window`` positions
    # (itself included). With ``layer_types`` only the "sliding_attention" layers do
    # (Gemma's interleaving); without, every layer (Mistral v0.1, Phi-3). None: no window.
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    hidden_act: str = "silu"
    # Rotary dimension as a fraction of head_dim (Phi-3 family's partial rotary).
    partial_rotary_factor: float = 1.0
    # Gemma 3: the local (sliding) layers' own RoPE base and scaling; None: the global ones.
    rope_local_theta: float | None = None
    rope_local_scaling: dict[str, Any] | None = None
    # Gemma: queries scaled by query_pre_attn_scalar**-0.5 instead of head_dim**-0.5.
    query_pre_attn_scalar: float | None = None
    # Gemma 2: tanh soft-capping of attention scores; Gemma 2/3: of the final logits.
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Mixture of experts (Qwen3-MoE, Mixtral); num_experts 0: a dense model. Each token
    # picks num_experts_per_tok experts of moe_intermediate_size; norm_topk_prob: their
    # weights renormalised to sum to 1 (always for Mixtral).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    # Qwen3-MoE: these layers keep the dense MLP, and only every decoder_sparse_step-th
    # layer has experts.
    mlp_only_layers: list[int] = field(default_factory=list)
    decoder_sparse_step: int = 1
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    torch_dtype: str | None = None  # the checkpoint's dtype ("bfloat16", ...)
    model_path: str = ""

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def attention_scale(self) -> float:
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """The window layer ``layer_idx`` attends over; None for full attention."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer_idx] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def long_rope_after(self) -> int | None:
        """Longrope: the pretraining length beyond which a request (by its prompt) runs
        on the long factors (model/layers/rotary.py); None for other RoPE."""
        return longrope_original_length(self.rope_scaling)

    @property
    def all_layers_sliding(self) -> bool:
        """Whether every layer has a window (then it bounds the servable context)."""
        return self.sliding_window is not None and all(
            self.layer_sliding_window(i) is not None for i in range(self.num_layers)
        )

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` has experts (else the dense MLP)."""
        return is_moe_layer(layer_idx, self.num_experts, self.mlp_only_layers,
                            self.decoder_sparse_step)

    @property
    def num_moe_layers(self) -> int:
        return sum(1 for i in range(self.num_layers) if self.is_moe_layer(i))

    def _mlp_params(self, experts: int) -> int:
        """All layers' MLP parameters, counting ``experts`` experts per MoE layer (and
        its router)."""
        h = self.hidden_size
        moe = self.num_moe_layers
        dense = (self.num_layers - moe) * 3 * h * self.intermediate_size
        if self.mlp_bias:
            dense += (self.num_layers - moe) * (2 * self.intermediate_size + h)
        return dense + moe * (experts * 3 * h * self.moe_intermediate_size + h * self.num_experts)

    @property
    def num_active_params(self) -> int:
        """Parameters one token's forward multiplies through, the lm_head included and
        the input embedding not: a MoE model's token uses its ``num_experts_per_tok``
        experts. ``2 * num_active_params`` is the usual FLOPs-per-token estimate."""
        return self.num_non_embedding_params - (
            self._mlp_params(self.num_experts) - self._mlp_params(self.num_experts_per_tok))

    @property
    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        q = self.num_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h
        if self.attention_bias:
            attn += q + 2 * kv
        per_layer = attn + 2 * h
        emb = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.num_layers * per_layer + self._mlp_params(self.num_experts) + emb + head + h

    @property
    def num_non_embedding_params(self) -> int:
        """Every parameter but the input embedding's (the lm_head included); a dense
        model's token multiplies through all of them (``num_active_params``)."""
        return self.num_params - self.vocab_size * self.hidden_size * (
            0 if self.tie_word_embeddings else 1
        )

    def kv_bytes_per_token(self, dtype_bytes: int, cache_dtype: str = "auto") -> int:
        """Bytes of K and V one token occupies across all layers (``cache_dtype``:
        ``--kv-cache-dtype``; an 8-bit cache's scales included)."""
        return 2 * self.num_layers * self.num_kv_heads * kv_row_bytes(
            self.head_dim, dtype_bytes, cache_dtype)

    def kv_bytes_per_block(self, block_size: int, dtype_bytes: int,
                           cache_dtype: str = "auto") -> int:
        return block_size * self.kv_bytes_per_token(dtype_bytes, cache_dtype)

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
        rope_theta, rope_scaling, local = _rope(cfg)
        if rope_scaling is not None and rope_scaling["rope_type"] in ("llama3", "yarn", "longrope"):
            # The pretraining length: a top-level one wins (Phi-3 keeps it beside
            # rope_scaling), else rope_scaling's, else max_position_embeddings (transformers).
            if cfg.get("original_max_position_embeddings"):
                rope_scaling["original_max_position_embeddings"] = int(
                    cfg["original_max_position_embeddings"])
            rope_scaling.setdefault("original_max_position_embeddings",
                                    int(cfg.get("max_position_embeddings", 2048)))
            rope_scaling.setdefault("max_position_embeddings",
                                    int(cfg.get("max_position_embeddings", 2048)))
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else list(eos))
        sliding_window = cfg.get("sliding_window")
        if family in ("qwen2", "qwen3", "qwen3moe") and not cfg.get("use_sliding_window", False):
            sliding_window = None
        layer_types = cfg.get("layer_types")
        num_layers = int(cfg["num_hidden_layers"])
        if family == "gemma3" and layer_types is None:
            pattern = int(cfg.get("sliding_window_pattern", 6))  # older Gemma 3 configs
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                           for i in range(num_layers)]
        if family == "gemma2" and layer_types is None:
            layer_types = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                           for i in range(num_layers)]
        if layer_types is not None and len(layer_types) != num_layers:
            raise ValueError(
                f"layer_types has {len(layer_types)} entries for {num_layers} layers"
            )
        gemma = family in ("gemma2", "gemma3")
        if gemma and cfg.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention (Gemma as an encoder) is not supported")
        flat_rope = cfg.get("rope_parameters") or {}
        if "rope_theta" not in flat_rope:  # per layer type: no partial rotary there
            flat_rope = {}
        partial = (cfg.get("partial_rotary_factor") or flat_rope.get("partial_rotary_factor")
                   or 1.0)
        return cls(
            architecture=arch,
            **moe_fields(cfg),
            num_layers=num_layers,
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
            # Qwen2 always has q/k/v biases; the others only when attention_bias says so.
            attention_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            # Gemma ties by default (its checkpoints carry no lm_head).
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
            sliding_window=int(sliding_window) if sliding_window else None,
            layer_types=list(layer_types) if layer_types is not None else None,
            hidden_act=str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"),
            partial_rotary_factor=float(partial),
            rope_local_theta=local[0] if local else None,
            rope_local_scaling=local[1] if local else None,
            query_pre_attn_scalar=(float(cfg.get("query_pre_attn_scalar", 256)) if gemma
                                   else None),
            attn_logit_softcapping=_opt_float(cfg.get("attn_logit_softcapping")),
            final_logit_softcapping=_opt_float(cfg.get("final_logit_softcapping")),
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


def longrope_original_length(scaling: dict[str, Any] | None) -> int | None:
    """The pretraining length beyond which longrope switches to its long factors."""
    if not scaling or scaling.get("rope_type") != "longrope":
        return None
    return int(scaling["original_max_position_embeddings"])


def _opt_float(v: Any) -> float | None:
    return None if v is None else float(v)


def _rope(
    cfg: dict[str, Any],
) -> tuple[float, dict[str, Any] | None, tuple[float, dict[str, Any] | None] | None]:
    """(rope_theta, scaling, local) from either transformers 4 (rope_theta +
    rope_scaling, Gemma 3's rope_local_base_freq) or transformers 5 (rope_parameters,
    per layer type for Gemma 3) config layouts; ``local``: the sliding layers' own
    (theta, scaling) where they have one, else None."""
    params = cfg.get("rope_parameters")
    local_params: dict[str, Any] | None = None
    if isinstance(params, dict) and "rope_theta" not in params and params:
        # Per-layer-type dict ({"full_attention": {...}, "sliding_attention": {...}}).
        local_params = params.get("sliding_attention")
        params = params.get("full_attention") or next(iter(params.values()))
    theta, scaling = _rope_one(cfg.get("rope_scaling"), params, cfg.get("rope_theta"))
    local = None
    if local_params is not None:
        local = _rope_one(None, local_params, None)
    elif cfg.get("rope_local_base_freq") is not None:
        local = (float(cfg["rope_local_base_freq"]), None)
    return theta, scaling, local


def _rope_one(
    rope_scaling: dict[str, Any] | None, params: dict[str, Any] | None, theta: Any
) -> tuple[float, dict[str, Any] | None]:
    scaling = rope_scaling or (dict(params) if isinstance(params, dict) else None)
    theta = float((params or {}).get("rope_theta") or theta or 10000.0)
    if scaling is not None:
        scaling = dict(scaling)
        rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
        if rope_type in ("su", "yarn") and "short_factor" in scaling:
            rope_type = "longrope"  # Phi-3's older spellings (transformers renames them too)
        scaling["rope_type"] = rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope_scaling type {rope_type!r}; supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if rope_type == "default":
            scaling = None
    return theta, scaling


def is_moe_layer(layer_idx: int, num_experts: int, mlp_only_layers: list[int],
                 decoder_sparse_step: int) -> bool:
    """Qwen3-MoE's rule (Mixtral's: no dense layers, step 1): experts unless the layer
    is in ``mlp_only_layers`` or off the ``decoder_sparse_step`` stride."""
    return (num_experts > 0 and layer_idx not in mlp_only_layers
            and (layer_idx + 1) % decoder_sparse_step == 0)


def moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """``ModelConfig``'s mixture-of-experts fields from a Qwen3-MoE or Mixtral
    ``config.json`` (none for a dense model); the simulator's roofline reads them too."""
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if not experts:
        return {}
    k = int(cfg.get("num_experts_per_tok") or 0)
    if not 1 <= k <= experts:
        raise ValueError(f"num_experts_per_tok must be in 1..{experts} (the experts), got {k}")
    # Qwen3-MoE names its experts' size (and spells the count num_experts, or as
    # transformers 5 writes it, num_local_experts); Mixtral's experts are intermediate_size.
    if "moe_intermediate_size" not in cfg:  # Mixtral: every layer sparse
        return dict(num_experts=experts, num_experts_per_tok=k, norm_topk_prob=True,
                    moe_intermediate_size=int(cfg["intermediate_size"]))
    step = cfg.get("decoder_sparse_step")
    step = 1 if step is None else int(step)
    if step < 1:
        raise ValueError(f"decoder_sparse_step must be >= 1, got {step}")
    return dict(
        num_experts=experts, num_experts_per_tok=k,
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        mlp_only_layers=[int(i) for i in cfg.get("mlp_only_layers") or []],
        decoder_sparse_step=step,
    )
