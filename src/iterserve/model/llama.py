"""The Llama family (Llama 2/3, Mistral, Qwen2) in plain PyTorch.

Tokens arrive flattened: ``input_ids`` and ``positions`` are ``[num_tokens]`` for
every request of the step together (no batch dimension, no padding), so every
projection and the MLP run as one matmul over the whole step. Only attention needs
to know which token belongs to which request; it reads that from the forward
context that the runner sets beside the call (``model.attention.forward_context``),
gpt-fast style, instead of threading metadata through every layer.

Parameter names follow Hugging Face, except that q/k/v and gate/up are stored
fused (``qkv_proj``, ``gate_up_proj``: one matmul instead of three or two);
``load_weights`` maps HF names onto the fused slices, so checkpoints load unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from iterserve.model.attention import Attention
from iterserve.model.linear import Linear, prepare_linears
from iterserve.model.model_config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # One fused op; in float32 it equals transformers' formula bit for bit.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Half precision: transformers' op order (normalize in float32, cast, scale).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], with the rope_scaling variants applied."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (
        cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    scaling = cfg.rope_scaling
    if not scaling:
        return inv_freq
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        # Llama 3.1: long wavelengths slowed by `factor`, short kept, a smooth ramp between.
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_type {rope_type!r}")


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """transformers' ``x * cos + rotate_half(x) * sin`` in three ops: rotate_half(x) is
    roll(x, D/2) with the first half negated, and the sign is folded into ``sin_signed``."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.attn = Attention(
            layer_idx, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        # RoPE on q and k together: one set of ops over [t, H + KVH, D].
        qk = apply_rope(
            qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim), cos, sin
        )
        q = qk[:, : self.num_heads]
        k = qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        out = self.attn(q, k, v)  # [t, num_heads * head_dim]
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = Linear(
            cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias
        )
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # In-place residual adds: inference only, nothing else holds x.
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x.add_(self.mlp(self.post_attention_layernorm(x)))


class LlamaModel(nn.Module):
    inv_freq: torch.Tensor  # a buffer (not a parameter): RoPE's inverse frequencies

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def decoder_layers(self) -> list[LlamaDecoderLayer]:
        """``layers``, typed (an nn.ModuleList yields plain Modules)."""
        return [cast(LlamaDecoderLayer, layer) for layer in self.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # cos/sin once per step for all layers; float32 like transformers, then cast.
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        cos = freqs.cos()
        sin = freqs.sin()
        cos = torch.cat((cos, cos), dim=-1).to(x.dtype)[:, None, :]
        sin = torch.cat((-sin, sin), dim=-1).to(x.dtype)[:, None, :]  # sign of rotate_half
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2: ``forward`` gives final hidden states for every token,
    ``compute_logits`` projects only the rows that sample (a prefill chunk needs none)."""

    # HF name fragment -> (our fused parameter, which shard)
    _STACKED = (
        ("q_proj", "qkv_proj", "q"),
        ("k_proj", "qkv_proj", "k"),
        ("v_proj", "qkv_proj", "v"),
        ("gate_proj", "gate_up_proj", 0),
        ("up_proj", "gate_up_proj", 1),
    )

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

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
        tied = [self.lm_head] if self.config.tie_word_embeddings else []
        return prepare_linears(groups, tied, packed_weights=packed_weights, gemv=gemv, cpp=cpp)

    def decoder_tensors(self) -> tuple[list[torch.Tensor], list[int]] | None:
        """The tensors and dimensions ``cpu_ops.Decoder`` takes, in its order: every
        projection's weight row-major (the single-row kernel's layout; made so here if
        the load-time choice picked another), a missing bias as an empty tensor. None
        when those row-major copies would take more than the extra weight memory
        ``linear.PACKED_WEIGHTS_MAX_BYTES`` allows (large models keep the torch path).
        The projection weights are moved into transparent huge pages (``hugepages``)."""
        from iterserve.model import hugepages
        from iterserve.model.linear import PACKED_WEIGHTS_MAX_BYTES, set_gemv_mode

        linears = [m for m in self.modules() if isinstance(m, Linear)]
        extra = sum(
            m.weight.numel() * m.weight.element_size()
            for m in linears
            if m.gemv_mode != "cpp" and not m.weight.is_contiguous()
        )
        if extra > PACKED_WEIGHTS_MAX_BYTES:
            return None
        cfg = self.config
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

        m = self.model
        tensors = [m.embed_tokens.weight.detach(), m.norm.weight.detach(), *lin(self.lm_head)]
        tensors.append(m.inv_freq)
        for layer in m.decoder_layers():
            a, mlp = layer.self_attn, layer.mlp
            tensors += [layer.input_layernorm.weight.detach(), *lin(a.qkv_proj), *lin(a.o_proj)]
            tensors += [layer.post_attention_layernorm.weight.detach(), *lin(mlp.gate_up_proj)]
            tensors += lin(mlp.down_proj)
        dims = [cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                cfg.intermediate_size, cfg.vocab_size]
        return tensors, dims

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into our (partly fused) parameters; returns names loaded."""
        cfg = self.config
        params = dict(self.named_parameters())
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        qkv_slices = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}
        inter = cfg.intermediate_size
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue  # tied: the embedding is the head
            target, lo, hi = name, None, None
            for hf, ours, shard in self._STACKED:
                if f".{hf}." in name:
                    target = name.replace(hf, ours)
                    if isinstance(shard, str):
                        lo, hi = qkv_slices[shard]
                    else:
                        lo, hi = shard * inter, (shard + 1) * inter
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {cfg.architecture}")
            dst = param.data if lo is None else param.data[lo:hi]
            if dst.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dst.shape)}"
                )
            dst.copy_(tensor)
            loaded.add(name)
        return loaded

    def expected_weight_names(self) -> set[str]:
        """HF names a complete checkpoint provides (for a missing-weights check)."""
        names: set[str] = set()
        for name, _ in self.named_parameters():
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if "qkv_proj" in name:
                names.update(name.replace("qkv_proj", p) for p in ("q_proj", "k_proj", "v_proj"))
            elif "gate_up_proj" in name:
                names.update(name.replace("gate_up_proj", p) for p in ("gate_proj", "up_proj"))
            else:
                names.add(name)
        return names
