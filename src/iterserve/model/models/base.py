"""What every decoder-only family shares: the pre-norm decoder layer, the model body
(embedding, layers, final norm, RoPE tables), and ``CausalLM`` (lm_head, logits, the
kernel preparation and the checkpoint loader).

Tokens arrive flattened: ``input_ids`` and ``positions`` are ``[num_tokens]`` for
every request of the step together (no batch dimension, no padding), so every
projection and the MLP run as one matmul over the whole step. Only attention needs
to know which token belongs to which request; it reads that from the forward
context that the runner sets beside the call (``model.attention.forward_context``),
gpt-fast style, instead of threading metadata through every layer.

Parameter names follow Hugging Face, except that q/k/v and gate/up are stored
fused (``qkv_proj``, ``gate_up_proj``: one matmul instead of three or two);
``CausalLM.load_weights`` maps HF names onto the fused slices (``stacked_params``),
so checkpoints load unchanged; a family whose checkpoints are already fused (Phi-3)
declares none.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import cast

import torch
from torch import nn

from iterserve.model.attention import Attention
from iterserve.model.layers.attention import QKVAttention, RopeTable
from iterserve.model.layers.mlp import GatedMLP
from iterserve.model.layers.norms import RMSNorm
from iterserve.model.layers.rotary import RotaryEmbedding
from iterserve.model.linear import Linear, prepare_linears
from iterserve.model.model_config import ModelConfig

# The C++ one-token decoder's inputs (cpu_ops.Decoder): its tensors, its dimensions, and
# per quantized projection (index in the tensors, set_quant's tensors, its ints).
DecoderTensors = tuple[list[torch.Tensor], list[int], list[tuple[int, list[torch.Tensor], list[int]]]]

NormFactory = Callable[[int, float], RMSNorm]

# HF name fragment -> (our fused parameter, which shard): q/k/v by name, gate/up by index.
STACKED_QKV_GATE_UP: tuple[tuple[str, str, str | int], ...] = (
    ("q_proj", "qkv_proj", "q"),
    ("k_proj", "qkv_proj", "k"),
    ("v_proj", "qkv_proj", "v"),
    ("gate_proj", "gate_up_proj", 0),
    ("up_proj", "gate_up_proj", 1),
)


def _embedding(num: int, dim: int) -> nn.Embedding:
    """``nn.Embedding(num, dim)``, with no initialization on the meta device (the loader
    builds models there): ``normal_`` on a meta tensor runs torch's Python reference
    implementation, whose first call imports torch._dynamo and sympy (~80 MiB resident
    for the life of the process)."""
    weight = torch.empty(num, dim)  # on the default device: meta inside torch.device("meta")
    if weight.device.type != "meta":
        nn.init.normal_(weight)
    return nn.Embedding(num, dim, _weight=weight)


class DecoderLayer(nn.Module):
    """Pre-norm: ``x + attn(norm(x))``, then ``x + mlp(norm(x))`` (Llama, Qwen, Phi-3)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, *, norm: NormFactory = RMSNorm,
                 qk_norm: NormFactory | None = None) -> None:
        super().__init__()
        self.input_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = QKVAttention(cfg, layer_idx, qk_norm=qk_norm)
        self.post_attention_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias,
                            act=cfg.hidden_act)

    def forward(self, x: torch.Tensor, rope: RopeTable) -> torch.Tensor:
        # In-place residual adds: inference only, nothing else holds x. The first add
        # goes into the post-attention norm (one pass where the fused kernel runs).
        x, h = self.post_attention_layernorm.add_forward(
            self.self_attn(self.input_layernorm(x), rope), x)
        return x.add_(self.mlp(h))


class DecoderModel(nn.Module):
    """Embedding, the decoder layers, the final norm; RoPE cos/sin once per step for
    every layer (one table per RoPE the family has, ``rotary``)."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer: Callable[[ModelConfig, int], nn.Module],
        *,
        norm: NormFactory = RMSNorm,
        rotary: dict[str, RotaryEmbedding] | None = None,
        embed_scale: bool = False,
    ) -> None:
        super().__init__()
        self.embed_tokens = _embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        if rotary is None:
            rotary = {"default": RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta,
                                                 cfg.rope_scaling, cfg.max_position_embeddings)}
        self.rotary = nn.ModuleDict(rotary)
        # Gemma scales the embedding by sqrt(hidden), the factor rounded to the model
        # dtype first, as transformers does.
        self.embed_scale = float(cfg.hidden_size) ** 0.5 if embed_scale else None

    @property
    def inv_freq(self) -> torch.Tensor:
        """The (first) RoPE's inverse frequencies."""
        return cast(RotaryEmbedding, next(iter(self.rotary.values()))).inv_freq

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype, device=x.device)
        rope = {name: r(positions, x.dtype) for name, r in self.rotary.items()}
        for layer in self.layers:
            x = layer(x, rope)
        return self.norm(x)


class CausalLM(nn.Module):
    """A decoder-only LM: ``forward`` gives final hidden states for every token,
    ``compute_logits`` projects only the rows that sample (a prefill chunk needs none)."""

    stacked_params: tuple[tuple[str, str, str | int], ...] = STACKED_QKV_GATE_UP

    def __init__(self, cfg: ModelConfig, model: DecoderModel) -> None:
        super().__init__()
        self.config = cfg
        self.model = model
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Tied embeddings: the embedding is the head (again after ``to_empty``)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def reset_buffers(self, device: torch.device) -> None:
        """Recompute the non-parameter buffers (RoPE) on ``device`` after a meta build."""
        for m in self.modules():
            if isinstance(m, RotaryEmbedding):
                m.reset_buffers(device)

    def attention_layers(self) -> list[Attention]:
        """Every layer's attention backend module, in layer order (the runner binds
        their KV caches)."""
        return [m for m in self.modules() if isinstance(m, Attention)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def prepare_for_inference(self, *, packed_weights: bool = True, gemv: str = "auto",
                              cpp: bool = False) -> dict:
        """Lay out the projections and pick their CPU kernels (see model/linear.py;
        ``cpp``: our C++ kernels may be used). A tied lm_head stays row-major, as the
        embedding lookup wants."""
        groups: dict[str, list[Linear]] = {}
        for name, m in self.named_modules():
            if isinstance(m, Linear):
                role = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
                groups.setdefault(role, []).append(m)
        for role, layers in self.extra_linear_groups().items():
            groups.setdefault(role, []).extend(layers)
        tied = [self.lm_head] if self.config.tie_word_embeddings else []
        return prepare_linears(groups, tied, packed_weights=packed_weights, gemv=gemv, cpp=cpp)

    def extra_linear_groups(self) -> dict[str, list[Linear]]:
        """Projections outside the module tree that take kernels as the others do
        (a family's per-expert views), by role."""
        return {}

    def decoder_tensors(self) -> DecoderTensors | None:
        """The C++ one-token decoder's tensors (``cpu_ops.Decoder``); None where the
        family has no such path (only Llama's layer and Qwen3's have one:
        ``llama.fused_decoder_tensors``)."""
        return None

    def shard_range(self, shard: str | int) -> tuple[int, int]:
        """Rows of a fused parameter that an HF shard fills (``stacked_params``)."""
        cfg = self.config
        if isinstance(shard, int):  # gate (0) / up (1)
            inter = cfg.intermediate_size
            return shard * inter, (shard + 1) * inter
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}[shard]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into our (partly fused) parameters; returns names loaded."""
        cfg = self.config
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue  # tied: the embedding is the head
            target, rows = name, None
            for hf, ours, shard in self.stacked_params:
                if f".{hf}." in name:
                    target = name.replace(hf, ours)
                    rows = self.shard_range(shard)
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {cfg.architecture}")
            self.load_param(param, rows, name, tensor)
            loaded.add(name)
        return loaded

    @staticmethod
    def load_param(param: torch.Tensor, rows: tuple[int, int] | None, name: str,
                   tensor: torch.Tensor) -> None:
        """Copy one checkpoint tensor into ``param`` (or its ``rows`` of a fused one)."""
        dst = param.data if rows is None else param.data[rows[0] : rows[1]]
        if dst.shape != tensor.shape:
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(dst.shape)}"
            )
        dst.copy_(tensor)

    def expected_weight_names(self) -> set[str]:
        """HF names a complete checkpoint provides (for a missing-weights check)."""
        fused: dict[str, list[str]] = {}
        for hf, ours, _ in self.stacked_params:
            fused.setdefault(ours, []).append(hf)
        names: set[str] = set()
        for name, _ in self.named_parameters():
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            for ours, parts in fused.items():
                if f".{ours}." in name:
                    names.update(name.replace(ours, p) for p in parts)
                    break
            else:
                names.add(name)
        return names
