"""What the mixture-of-experts families (Qwen3-MoE, Mixtral) share: the decoder layer
with a ``FusedMoE`` block (``layers/moe.py``) in place of the dense MLP where the
config says so, and the checkpoint names of its experts in both layouts.

Checkpoints on disk name every expert apart (``mlp.experts.{i}.gate_proj.weight``;
Mixtral's ``block_sparse_moe.experts.{i}.w1.weight``); transformers 5 holds them fused
in memory (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I])
and its ``save_pretrained`` writes the per-expert names back. Both load here.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from iterserve.model.layers.moe import FusedMoE, time_dot_crossover
from iterserve.model.layers.norms import RMSNorm
from iterserve.model.linear import Linear
from iterserve.model.model_config import ModelConfig
from iterserve.model.models.base import CausalLM, DecoderLayer, NormFactory


class MoEDecoderLayer(DecoderLayer):
    """The pre-norm decoder layer; its ``mlp`` a ``FusedMoE`` on the config's MoE layers
    (``ModelConfig.is_moe_layer``), the dense gated MLP on the others."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, *,
                 qk_norm: NormFactory | None = None, style: str = "qwen") -> None:
        super().__init__(cfg, layer_idx, norm=RMSNorm, qk_norm=qk_norm)
        if cfg.is_moe_layer(layer_idx):
            if cfg.hidden_act not in ("silu", "swish"):
                raise ValueError(f"MoE experts support hidden_act silu, got {cfg.hidden_act!r}")
            self.mlp = FusedMoE(  # type: ignore[assignment]
                cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                cfg.num_experts_per_tok, renormalize=cfg.norm_topk_prob,
                float32_weights=style == "mixtral", style=style,
            )


class MoECausalLM(CausalLM):
    """``CausalLM`` whose MoE blocks take their checkpoint tensors themselves; the rest
    (attention, norms, dense MLPs) loads as in every family. ``moe_prefix``: the
    checkpoint's name of the block in a layer (``mlp``; Mixtral's ``block_sparse_moe``)."""

    moe_prefix = "mlp"

    def moe_blocks(self) -> dict[str, FusedMoE]:
        """``model.layers.{i}`` -> that layer's MoE block."""
        blocks: dict[str, FusedMoE] = {}
        for i, layer in enumerate(self.model.layers):
            mlp = getattr(layer, "mlp", None)
            if isinstance(mlp, FusedMoE):
                blocks[f"model.layers.{i}"] = mlp
        return blocks

    def prepare_for_inference(self, *, packed_weights: bool = True, gemv: str = "auto",
                              cpp: bool = False) -> dict:
        """As every family, after packing the MoE blocks for the C++ experts kernel
        where it runs (``FusedMoE.pack_for_cpu``); the blocks it does not take keep
        per-expert projections with kernels chosen as the dense ones'."""
        blocks = list(self.moe_blocks().values())
        packed = [b for b in blocks if b.pack_for_cpu()] if cpp else []
        chosen = super().prepare_for_inference(packed_weights=packed_weights, gemv=gemv, cpp=cpp)
        if packed:
            crossover = time_dot_crossover(packed[0])
            for b in packed:
                b.dot_max_tokens = crossover
            chosen["moe_experts"] = "cpp"
            chosen["moe_dot_max_tokens"] = crossover
        return chosen

    def extra_linear_groups(self) -> dict[str, list[Linear]]:
        """Every MoE block's per-expert projections, one role each for gate+up and down
        across the layers (blocks packed for the C++ kernel have none)."""
        groups: dict[str, list[Linear]] = {}
        for block in self.moe_blocks().values():
            if block.packed:
                continue
            w13, w2 = block.expert_linears()
            groups.setdefault("mlp.experts.w13", []).extend(w13)
            groups.setdefault("mlp.experts.w2", []).extend(w2)
        return groups

    def _moe_target(self, name: str, blocks: dict[str, FusedMoE]) -> tuple[FusedMoE, str] | None:
        """(the block, the name relative to it) when ``name`` is an MoE block's tensor."""
        parts = name.split(".", 4)  # model, layers, i, block, rest
        if len(parts) < 5 or parts[3] not in (self.moe_prefix, "mlp"):
            return None
        block = blocks.get(".".join(parts[:3]))
        return None if block is None else (block, parts[4])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        blocks = self.moe_blocks()
        loaded: set[str] = set()
        rest: list[tuple[str, torch.Tensor]] = []
        for name, tensor in weights:
            hit = self._moe_target(name, blocks)
            if hit is None:
                rest.append((name, tensor))
                continue
            block, local = hit
            covers = block.load_expert_weight(local, tensor)
            if not covers:
                raise ValueError(f"checkpoint tensor {name!r} has no place in "
                                 f"{self.config.architecture}")
            layer = name.split(".", 3)
            loaded |= {f"{'.'.join(layer[:3])}.{self.moe_prefix}.{c}" for c in covers}
        return loaded | super().load_weights(rest)

    def expected_weight_names(self) -> set[str]:
        blocks = self.moe_blocks()
        names = {n for n in super().expected_weight_names()
                 if self._moe_target(n, blocks) is None}
        for prefix, block in blocks.items():
            names |= {f"{prefix}.{self.moe_prefix}.{n}" for n in block.expected_weight_names()}
        return names
