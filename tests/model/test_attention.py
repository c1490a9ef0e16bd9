"""The attention layer's prefill paths against each other: a chunk on a cached prefix
attends (on CPU) in two flash calls merged by log-sum-exp; the explicit-mask path over
the gathered context is the reference it replaces."""

from __future__ import annotations

import pytest
import torch

from iterserve.model.attention import (
    Attention,
    AttentionMetadata,
    PrefillChunk,
    forward_context,
    prefix_split_available,
)


def test_the_pinned_torch_has_the_cpu_flash_op():
    """torch >= 2.4 (pyproject) has it: the split path below always runs on CPU."""
    assert prefix_split_available(torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("cached", "new"), [(1, 5), (16, 16), (37, 90), (200, 3)])
def test_chunk_on_a_prefix_split_equals_the_masked_path(dtype, cached, new):
    torch.manual_seed(cached + new)
    heads, kv_heads, hd, bs, num_blocks = 8, 2, 32, 8, 64
    layer = Attention(0, heads, kv_heads, hd, hd**-0.5)
    layer.kv_cache = torch.randn(2, num_blocks, bs, kv_heads, hd).to(dtype)
    ctx = cached + new
    blocks = torch.randperm(num_blocks)[: -(-ctx // bs)]
    pos = torch.arange(cached, ctx)
    slots = blocks[pos // bs] * bs + pos % bs
    q = torch.randn(new, heads, hd).to(dtype)
    k = torch.randn(new, kv_heads, hd).to(dtype)
    v = torch.randn(new, kv_heads, hd).to(dtype)
    mask = torch.arange(ctx)[None, :] <= (cached + torch.arange(new))[:, None]
    outs = []
    for m in (None, mask):
        chunk = PrefillChunk(0, new, cached, block_ids=blocks, mask=m)
        meta = AttentionMetadata(slot_mapping=slots, prefills=[chunk])
        with forward_context(meta):
            outs.append(layer.attend(q, k, v).float())
    split, masked = outs
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(split, masked, **tol)
