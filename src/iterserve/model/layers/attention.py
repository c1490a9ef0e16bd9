"""The decoder's self-attention block: fused ``qkv_proj``, optional per-head q/k norms
(Qwen3, Gemma 3), RoPE, the paged attention backend (``model/attention.py``), ``o_proj``.

Each block reads its cos/sin from the step's rope table by ``rope_key`` (Gemma 3's
local layers have their own RoPE base), so the model computes them once per step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from iterserve.model.attention import Attention
from iterserve.model.layers.norms import FUSED_DTYPES
from iterserve.model.layers.rotary import apply_rope
from iterserve.model.linear import Linear
from iterserve.model.model_config import ModelConfig

RopeTable = dict[str, tuple[torch.Tensor, torch.Tensor]]


class QKVAttention(nn.Module):
    cpu_fused = False  # set by the runner where the C++ kernels run: RoPE in one pass

    def __init__(
        self,
        cfg: ModelConfig,
        layer_idx: int,
        *,
        qk_norm: Callable[[int, float], nn.Module] | None = None,
        rope_key: str = "default",
    ) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.rope_key = rope_key
        self.qkv_proj = Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if qk_norm is not None:
            self.q_norm = qk_norm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = qk_norm(cfg.head_dim, cfg.rms_norm_eps)
        self.attn = Attention(
            layer_idx, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.attention_scale,
            sliding_window=cfg.layer_sliding_window(layer_idx),
            logit_softcap=cfg.attn_logit_softcapping,
        )

    def forward(self, x: torch.Tensor, rope: RopeTable) -> torch.Tensor:
        t = x.shape[0]
        cos, sin = rope[self.rope_key]
        qkv = self.qkv_proj(x)
        qk_end = self.q_size + self.kv_size
        v = qkv[:, qk_end:].view(t, self.num_kv_heads, self.head_dim)
        rope_ = self._rope_in_place(qkv)
        if self.q_norm is None or self.k_norm is None:
            # RoPE on q and k together: one pass over [t, H + KVH, D].
            qk = qkv[:, :qk_end].view(t, -1, self.head_dim)
            if rope_ is not None:
                rope_(qk, cos, sin)  # in place: qkv is this step's own
            else:
                qk = apply_rope(qk, cos, sin)
            q = qk[:, : self.num_heads]
            k = qk[:, self.num_heads :]
        else:  # per-head norms first, then RoPE
            q = self.q_norm(qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size : qk_end].view(t, self.num_kv_heads, self.head_dim))
            if rope_ is not None:
                rope_(q, cos, sin)
                rope_(k, cos, sin)
            else:
                q = apply_rope(q, cos, sin)
                k = apply_rope(k, cos, sin)
        out = self.attn(q, k, v)  # [t, num_heads * head_dim]
        return self.o_proj(out)

    def _rope_in_place(self, qkv: torch.Tensor) -> Callable[..., None] | None:
        """The C++ in-place RoPE (``csrc/norm_act.cpp``) where it applies, else None."""
        if self.cpu_fused and not torch.compiler.is_compiling() and qkv.dtype in FUSED_DTYPES:
            return torch.ops.iterserve_cpu.rope_
        return None
