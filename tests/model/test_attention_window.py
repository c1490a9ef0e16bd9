"""Sliding-window and soft-capped attention (``attention_window``) against a dense
reference over each request's whole context, for every view of a step the runner
builds (the C++ kernels' paged views, the torch path's decode groups and prefill
chunks); and where the window does not bind, the fast paths (C++ kernels included)
give the same as the windowed one."""

from __future__ import annotations

import pytest
import torch

from iterserve.model import cpu_ops
from iterserve.model.attention import (
    Attention,
    AttentionMetadata,
    DecodeGroup,
    PrefillChunk,
    forward_context,
)

HEADS, KV_HEADS, HD, BS, NUM_BLOCKS = 4, 2, 16, 4, 64


def reference(q, keys, values, window, cap, scale):
    """q: [n, H, D] (the context's last n positions); keys/values: [L, KVH, D]."""
    n, L = q.shape[0], keys.shape[0]
    k = keys.repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1)  # [H, L, D]
    v = values.repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1)
    s = q.transpose(0, 1) @ k.transpose(1, 2) * scale  # [H, n, L]
    if cap:
        s = cap * torch.tanh(s / cap)
    qpos = torch.arange(L - n, L)[:, None]
    kpos = torch.arange(L)[None, :]
    ok = (kpos <= qpos) & ((kpos > qpos - window) if window else True)
    return (s.masked_fill(~ok, float("-inf")).softmax(-1) @ v).transpose(0, 1)


def make_step(contexts, news, view):
    """Requests with ``contexts[i]`` tokens in all, the last ``news[i]`` of them new this
    step (1: a decode row); their blocks, slots and the step's metadata in ``view``
    ('paged': the C++ kernels' tensors, 'grouped': the torch path's)."""
    g = torch.Generator().manual_seed(sum(contexts))
    perm = torch.randperm(NUM_BLOCKS, generator=g)
    tables, slots, used = [], [], 0
    for ctx, n in zip(contexts, news):
        nb = -(-ctx // BS)
        table = perm[used : used + nb]
        used += nb
        tables.append(table)
        pos = torch.arange(ctx - n, ctx)
        slots.append(table[pos // BS] * BS + pos % BS)
    meta = AttentionMetadata(slot_mapping=torch.cat(slots), max_context_len=max(contexts))
    dec = [i for i, n in enumerate(news) if n == 1]
    assert dec == list(range(len(dec))), "decode rows first"
    meta.num_decode_tokens = len(dec)
    width = max(len(t) for t in tables)
    padded = torch.zeros(len(tables), width, dtype=torch.long)
    for i, t in enumerate(tables):
        padded[i, : len(t)] = t
    if dec and view == "paged":
        meta.decode_block_table = padded[: len(dec)]
        meta.decode_context_lens = torch.tensor([contexts[i] for i in dec])
    elif dec:
        for i in dec:  # one group per row (lone rows trimmed), or one masked group
            meta.decode_groups.append(DecodeGroup(i, i + 1, padded[i : i + 1],
                                                  context_len=contexts[i]))
    start = len(dec)
    for i in range(len(dec), len(news)):
        c = contexts[i] - news[i]
        chunk = PrefillChunk(start, start + news[i], c)
        if c and view == "grouped":
            chunk.block_ids = tables[i]
        meta.prefills.append(chunk)
        start += news[i]
    if view == "paged" and meta.prefills:
        meta.prefill_block_table = padded[len(dec):]
        lens = [p.q_end - p.q_start for p in meta.prefills]
        meta.prefill_query_start = torch.tensor([0, *lens]).cumsum(0)
        meta.prefill_computed = torch.tensor([p.num_computed_tokens for p in meta.prefills])
    return meta, tables


@pytest.mark.parametrize("view", ["paged", "grouped"])
@pytest.mark.parametrize(("window", "cap"), [(5, None), (None, 2.0), (7, 3.0)])
def test_windowed_attention_equals_dense_reference(view, window, cap):
    torch.manual_seed(0)
    contexts, news = [3, 30, 9, 26, 40], [1, 1, 9, 8, 40]
    layer = Attention(0, HEADS, KV_HEADS, HD, 0.3, sliding_window=window, logit_softcap=cap)
    kv = torch.randn(2, NUM_BLOCKS, BS, KV_HEADS, HD)
    layer.kv_cache = kv
    meta, tables = make_step(contexts, news, view)
    t = sum(news)
    q, k, v = torch.randn(t, HEADS, HD), torch.randn(t, KV_HEADS, HD), torch.randn(t, KV_HEADS, HD)
    with forward_context(meta):
        out = layer.attend(q, k, v).view(t, HEADS, HD)
    row = 0
    for ctx, n, table in zip(contexts, news, tables):
        ctx_kv = kv[:, table].flatten(1, 2)[:, :ctx]  # K/V as written by the step
        ref = reference(q[row : row + n], ctx_kv[0], ctx_kv[1], window, cap, 0.3)
        torch.testing.assert_close(out[row : row + n], ref, atol=1e-5, rtol=1e-5)
        row += n


@pytest.mark.parametrize("cpp", [False, True])
def test_unbinding_window_takes_the_fast_paths(cpp, monkeypatch):
    """Every context within the window: the C++ kernels (or SDPA) run, as for a full
    layer, and agree with the windowed path forced by an unknown context length."""
    if cpp and not cpu_ops.prefill_available(HD):
        pytest.skip("C++ kernels not built here")
    torch.manual_seed(1)
    contexts, news = [6, 12, 10], [1, 1, 10]
    layer = Attention(0, HEADS, KV_HEADS, HD, 0.25, sliding_window=16)
    layer.cpu_decode = cpp
    init = torch.randn(2, NUM_BLOCKS, BS, KV_HEADS, HD)
    t = sum(news)
    q, k, v = torch.randn(t, HEADS, HD), torch.randn(t, KV_HEADS, HD), torch.randn(t, KV_HEADS, HD)
    from iterserve.model import attention, attention_window

    calls: list[int] = []

    def counted(*args):
        calls.append(1)
        return attention_window.windowed_attention(*args)

    monkeypatch.setattr(attention, "windowed_attention", counted)
    outs = []
    for known in (True, False):
        layer.kv_cache = init.clone()
        meta, _ = make_step(contexts, news, "paged" if cpp else "grouped")
        if not known:
            meta.max_context_len = 0
        if not cpp:
            meta.prefills[0].block_ids = None  # fresh chunk: straight from its K/V
        with forward_context(meta):
            outs.append(layer.attend(q, k, v))
        assert len(calls) == (0 if known else 1)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
