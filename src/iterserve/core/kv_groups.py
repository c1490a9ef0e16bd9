"""KV cache groups: layers that share one block table per request.

A model whose layers all attend globally has one group. A hybrid model (Gemma 2/3:
sliding-window "local" layers interleaved with global ones) has several, as vLLM's
hybrid KV cache manager: every group holds the same number of layers, so a block
id means the same bytes in every group and all groups draw ids from one pool. The
model keeps one physical tensor per position within a group ("slot"); layer ``j``
of every group uses slot ``j``'s tensor, at the block ids of its own group's table.
A sliding-window group's table drops the blocks its window has left (they become
the null block), so a long context holds its full length only in the global groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVCacheGroupSpec:
    """One group: its layers' window (None: full attention) and the model's indices
    of its layers (in slot order; fewer than the group size in a padded last group)."""

    sliding_window: int | None = None
    layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")


def first_needed_block(num_computed: int, window: int | None, block_size: int) -> int:
    """The first block a step starting at ``num_computed`` still reads: its first query
    (position ``num_computed``) sees keys from ``num_computed - window + 1`` on, and
    every later query sees later keys. Blocks before it are out of the window for
    this step and every step after."""
    if window is None:
        return 0
    first = num_computed - window + 1
    return first // block_size if first > 0 else 0


def make_kv_cache_groups(layer_windows: Sequence[int | None]) -> list[KVCacheGroupSpec]:
    """Groups for a model whose layer ``i`` attends over ``layer_windows[i]`` (None:
    globally): vLLM's uniform-page rule. Layers of one kind split, in layer order,
    into groups of the size of the smallest kind (the last group of a kind may be
    short: its missing slots are padding); full-attention groups first. One kind of
    layer makes one group of every layer."""
    if not layer_windows:
        raise ValueError("layer_windows must name at least one layer")
    kinds: dict[int | None, list[int]] = {}
    for i, w in enumerate(layer_windows):
        if w is not None and w < 1:
            raise ValueError(f"layer_windows[{i}] must be >= 1 or None, got {w}")
        kinds.setdefault(w, []).append(i)
    if len(kinds) == 1:
        ((w, layers),) = kinds.items()
        return [KVCacheGroupSpec(w, tuple(layers))]
    size = min(len(v) for v in kinds.values())
    # Full attention first, then windows in ascending order: a stable order.
    order = sorted(kinds, key=lambda w: -1 if w is None else w)
    groups = []
    for w in order:
        layers = kinds[w]
        for s in range(0, len(layers), size):
            groups.append(KVCacheGroupSpec(w, tuple(layers[s : s + size])))
    return groups


def group_size(groups: Sequence[KVCacheGroupSpec]) -> int:
    """Layers per group: the number of physical slot tensors."""
    return max(len(g.layers) for g in groups) if groups else 0
