"""Quantized weights under Hugging Face names onto a built model's ``Linear`` layers:
the shards of a fused projection (q/k/v, gate/up) stacked in the order the model
declares (its ``stacked_params``), a projection whose shards are not all quantized loaded as
floats instead."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from iterserve.model.linear import Linear, set_quant
from iterserve.model.quant.packed import QuantTensor, QuantWeight

logger = logging.getLogger(__name__)


class QuantAttacher:
    """Collects (HF name, packed weight) pairs, then ``finish`` installs them."""

    def __init__(self, model: Any, source: object, act_dynamic_int8: bool = False) -> None:
        self.model = model
        self.source = source
        self.act_dynamic_int8 = act_dynamic_int8  # W8A8: many rows as one int8 GEMM
        self.modules = dict(model.named_modules())
        self.load_weights: Callable[[list[tuple[str, torch.Tensor]]], set[str]] = (
            model.load_weights)
        self.parts: dict[str, list[tuple[int, str, QuantTensor]]] = {}
        self.shards: dict[str, int] = {}
        self.installed = 0

    def target(self, hf: str) -> tuple[str, int, int]:
        """(the Linear's module name, this shard's position in it, its number of shards)."""
        stacked = getattr(self.model, "stacked_params", ())
        for frag, ours, _ in stacked:
            if f".{frag}." in hf:
                shards = [f for f, o, _ in stacked if o == ours]
                return hf.replace(frag, ours).rsplit(".", 1)[0], shards.index(frag), len(shards)
        return hf.rsplit(".", 1)[0], 0, 1

    def add(self, hf: str, qt: QuantTensor) -> None:
        target, pos, n = self.target(hf)
        if not isinstance(self.modules.get(target), Linear):
            raise ValueError(f"{self.source}: tensor for {hf!r} has no projection to go to")
        parts = self.parts.setdefault(target, [])
        parts.append((pos, hf, qt))
        self.shards[target] = n
        if len(parts) == n:  # complete: installed now, so the load holds one layer loose
            self._install(target, self.parts.pop(target))

    def _install(self, target: str, parts: list[tuple[int, str, QuantTensor]]) -> None:
        layer = self.modules[target]
        assert isinstance(layer, Linear)
        parts.sort(key=lambda p: p[0])
        set_quant(layer, QuantWeight([p for _, _, p in parts],
                                     act_dynamic_int8=self.act_dynamic_int8))
        self.installed += 1

    def finish(self) -> int:
        """Install what is left; returns how many projections run quantized."""
        for target, parts in self.parts.items():
            layer = self.modules[target]
            assert isinstance(layer, Linear)
            if len(parts) == self.shards[target]:
                self._install(target, parts)
            else:  # some shards stored as floats: the whole projection runs in floats
                logger.info("%s: quantized and float shards mixed; dequantized", target)
                with torch.no_grad():
                    for _, hf, p in parts:
                        self.load_weights([(hf, p.dequantize())])
        self.parts.clear()
        return self.installed
