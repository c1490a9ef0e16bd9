"""Attention for layers with a sliding window and/or score soft-capping (Mistral v0.1,
Phi-3, Gemma 2/3) on the torch paths, which SDPA cannot do.

``Attention.attend`` routes a layer here when the window or the cap changes the result
(with a window: some context in the step is longer than it) and our C++ kernels, which
take both, do not run the whole step. Per request
(every decode row, every prefill chunk) the scores over its context run in float32,
capped, masked to the causal window, softmaxed: transformers' eager attention.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from iterserve.model.attention import Attention, AttentionMetadata


def windowed_attention(
    layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """Writes the step's K/V, then attends per request -> [T, H * D]."""
    layer.write_kv(k, v, kv, meta)
    out = torch.empty_like(q)
    d = meta.num_decode_tokens
    if d:
        tables, ctx = _decode_rows(meta)
        for row in range(d):
            n = int(ctx[row])
            out[row : row + 1] = _windowed_one(layer, q[row : row + 1], kv, tables[row], n)
    for i, p in enumerate(meta.prefills):
        c, n = p.num_computed_tokens, p.q_end - p.q_start
        qs = q[p.q_start : p.q_end]
        if c == 0:
            o = _windowed_scores(layer, qs, k[p.q_start : p.q_end], v[p.q_start : p.q_end], 0)
        else:
            ids = p.block_ids
            if ids is None:
                assert meta.prefill_block_table is not None
                ids = meta.prefill_block_table[i]
            o = _windowed_one(layer, qs, kv, ids, c + n)
        out[p.q_start : p.q_end] = o
    return out.view(q.shape[0], layer.num_heads * layer.head_dim)


def _decode_rows(meta: AttentionMetadata) -> tuple[list[torch.Tensor], list[int]]:
    """Each decode row's block ids and context length, from whichever view the step has."""
    if meta.decode_block_table is not None:
        assert meta.decode_context_lens is not None
        return list(meta.decode_block_table), meta.decode_context_lens.tolist()
    tables: list[torch.Tensor] = []
    ctx: list[int] = []
    for g in meta.decode_groups:
        tables.extend(g.block_table)
        if g.context_len:
            ctx.append(g.context_len)
        else:
            assert g.mask is not None
            ctx.extend(g.mask.view(g.end - g.start, -1).sum(-1).tolist())
    return tables, ctx


def _windowed_one(
    layer: Attention, q: torch.Tensor, kv: torch.Tensor, block_ids: torch.Tensor, ctx: int
) -> torch.Tensor:
    """The last ``q.shape[0]`` positions of a ``ctx``-token context, over its blocks."""
    bs = kv.shape[2]
    first = 0
    if layer.sliding_window:  # only the blocks the window reaches
        first = max(0, ctx - q.shape[0] - layer.sliding_window + 1) // bs
    ids = block_ids[first : -(-ctx // bs)]
    kvs = layer.read_blocks(kv, ids, q.dtype)[:, : ctx - first * bs]  # [2, L, KVH, D]
    return _windowed_scores(layer, q, kvs[0], kvs[1], first * bs)


def _windowed_scores(
    layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_start: int
) -> torch.Tensor:
    """q: [n, H, D], the last n of the keys' positions; k, v: [L, KVH, D] at positions
    ``k_start ..``. -> [n, H, D]."""
    n, L = q.shape[0], k.shape[0]
    kvh, g, hd = layer.num_kv_heads, layer.group, layer.head_dim
    qg = q.float().view(n, kvh, g, hd).permute(1, 2, 0, 3)  # [KVH, G, n, D]
    s = torch.matmul(qg, k.float().permute(1, 2, 0)[:, None]) * layer.scale  # [KVH, G, n, L]
    if layer.logit_softcap:
        s = torch.tanh(s / layer.logit_softcap) * layer.logit_softcap
    qpos = torch.arange(k_start + L - n, k_start + L, device=q.device)[:, None]
    kpos = torch.arange(k_start, k_start + L, device=q.device)[None, :]
    allowed = kpos <= qpos
    if layer.sliding_window:
        allowed &= kpos > qpos - layer.sliding_window
    s = s.masked_fill(~allowed, float("-inf")).softmax(-1)
    o = torch.matmul(s, v.float().permute(1, 0, 2)[:, None])  # [KVH, G, n, D]
    return o.permute(2, 0, 1, 3).reshape(n, layer.num_heads, hd).to(q.dtype)
