"""Paged KV write + ragged attention over a flattened step.

The runner orders a step's tokens as ``[decodes | prefill chunks]``: the first
``num_decode_tokens`` tokens are one query each (a request with one scheduled
token), the rest are prefill chunks, contiguous per request. Every token's K/V
is written into the layer's paged cache through ``slot_mapping`` first; then

- decodes attend in one call of our C++ paged kernel (the cpp backend: each row
  over its own blocks in place, no copy, no padding), else in a few SDPA calls,
  one per group of similar context length, over their gathered blocks (queries
  grouped by KV head, so GQA needs no K/V repeat; padding to the group's longest
  context masked), and
- prefill chunks attend causally to themselves and to their cached prefixes: on
  an AVX-512 CPU with the cpp backend, every chunk of the step in one call of our
  C++ flash-style kernel over the paged cache (``csrc/prefill_attention.cpp``: no
  gather, no merge); else one chunk at a time, with
  no prefix straight from the fresh K/V (``is_causal``); with one, on CPU, in two
  flash calls merged by their log-sum-exps (the whole prefix, unmasked, then the
  chunk's own K/V causally: no mask and no masked-out half of the product), else
  over its gathered blocks with an explicit mask (query ``i`` sees key ``j`` iff
  ``j <= c + i``).

With the flash backend (CUDA, flash-attn installed, a block size it accepts; written
against flash-attn's API but never run on a GPU, see docs/backends.md), one fused
varlen kernel over the block tables does all of it instead. With the cpp backend, a
step that is a single decode (batch-1 decoding) normally never gets here (the runner
hands it to the C++ decoder, ``cpu_ops``); with that off, it still takes our C++
attention kernel, which writes the token's K/V and attends over the blocks in place,
in a fraction of the time the torch ops around SDPA take.

The layout itself (which rows decode, the groups, causal or masked prefill) is
``step_layout``'s; the metadata comes from the forward context the runner sets beside
the model call, so the model code never carries it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from iterserve.model.attention_window import windowed_attention
from iterserve.model.kv_quant import dequantize_rows, write_rows

try:  # optional fused kernel (CUDA only)
    from flash_attn import flash_attn_varlen_func
except Exception:  # any import failure means "not available"
    flash_attn_varlen_func = None

# scaled_dot_product_attention(enable_gqa=...) exists from torch 2.5.
_HAS_ENABLE_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)
# The CPU flash-attention op that SDPA calls, which also returns the log-sum-exp.
_cpu_flash: Any = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def prefix_split_available(device: torch.device) -> bool:
    """Whether a chunk on a cached prefix attends in two merged flash calls (CPU) rather
    than over a gathered copy with an explicit causal mask."""
    return device.type == "cpu" and _cpu_flash is not None


@dataclass(slots=True)
class PrefillChunk:
    """One request's prefill chunk: tokens ``[q_start, q_end)`` of the step."""

    q_start: int
    q_end: int
    num_computed_tokens: int
    # Only when num_computed_tokens > 0: block ids covering the context, and (where the
    # prefix is not attended separately, see prefix_split_available) the [n, c + n]
    # causal mask over it.
    block_ids: torch.Tensor | None = None
    mask: torch.Tensor | None = None


@dataclass(slots=True)
class DecodeGroup:
    """Decodes ``[start, end)`` of the step, attended together in one SDPA call."""

    start: int
    end: int
    block_table: torch.Tensor  # [n, max_blocks] long, padded with block 0
    mask: torch.Tensor | None = None  # [n, 1, 1, max_blocks * block_size] (n > 1)
    context_len: int = 0  # n == 1: the gathered context is trimmed to this instead


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] long: where each token's K/V goes
    num_decode_tokens: int = 0
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    # The paged path instead: every decode row's block table (padded) and context length.
    decode_block_table: torch.Tensor | None = None  # [num_decodes, max_blocks] long
    decode_context_lens: torch.Tensor | None = None  # [num_decodes] long
    prefills: list[PrefillChunk] = field(default_factory=list)
    # The C++ prefill kernel's view of the prefill chunks (when it runs them): each
    # chunk's block table (padded), its rows' bounds in the prefill part of the step
    # ([chunks + 1], from 0) and its cached tokens.
    prefill_block_table: torch.Tensor | None = None  # [chunks, max_blocks] long
    prefill_query_start: torch.Tensor | None = None  # [chunks + 1] long
    prefill_computed: torch.Tensor | None = None  # [chunks] long
    # A reusable flat buffer for gathered K and V (at least the largest gather of the
    # step). Fresh multi-MB tensors every layer would each be a new mmap plus page
    # faults; reusing one buffer makes the gather several times faster on CPU.
    kv_buf: torch.Tensor | None = None
    # Fused-kernel view of the same step (filled only when the flash path is used).
    use_flash: bool = False
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    block_table: torch.Tensor | None = None
    # The longest context (cached + new tokens) of any request in the step; 0: unknown.
    # A sliding-window layer attends as a full one when no context exceeds its window.
    max_context_len: int = 0
    # With KV cache groups (core/kv_groups.py): the step's metadata over each group's
    # block tables (this object first); a layer attends with its group's.
    groups: list[AttentionMetadata] | None = None


_forward_context: AttentionMetadata | None = None

# Attention layers by index, for the compiled model: torch.compile sees attention as
# one opaque op (``iterserve::attention``) and the op finds its layer here, as vLLM's
# unified attention op finds its layer by name. The runner registers its model's
# layers before each forward (a process may hold several models).
_layers: list[Attention] = []


def bind_layers(layers: list[Attention]) -> None:
    global _layers
    _layers = layers


@contextlib.contextmanager
def forward_context(meta: AttentionMetadata) -> Iterator[None]:
    global _forward_context
    prev, _forward_context = _forward_context, meta
    try:
        yield
    finally:
        _forward_context = prev


def get_forward_context() -> AttentionMetadata:
    if _forward_context is None:
        raise RuntimeError("attention called outside model.attention.forward_context()")
    return _forward_context


def flash_available(device: torch.device, block_size: int, dtype: torch.dtype) -> bool:
    # flash-attn's paged varlen kernel wants fp16/bf16 and page sizes that are
    # multiples of 256. (Not exercised by the CPU test suite.)
    return (
        flash_attn_varlen_func is not None
        and device.type == "cuda"
        and block_size % 256 == 0
        and dtype in (torch.float16, torch.bfloat16)
    )


class Attention(nn.Module):
    """Writes K/V into this layer's paged cache, then attends. No parameters.

    ``kv_cache`` is this layer's ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
    view (K then V) of the pool, bound by the runner after allocating it. With an 8-bit
    cache (``kv_quant``) it holds int8 or e4m3 values and ``kv_scales`` this layer's
    ``[2, num_blocks, block_size, num_kv_heads]`` per-row scales; else ``kv_scales`` is None.
    """

    def __init__(
        self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
        *, sliding_window: int | None = None, logit_softcap: float | None = None,
    ) -> None:
        super().__init__()
        # Each query sees the last `sliding_window` positions, itself included; scores
        # soft-capped as cap * tanh(s / cap) (Gemma 2). Our C++ kernels take both; the
        # torch paths go through ``windowed_attention`` whenever either changes the result.
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.scale = scale
        self.kv_cache: torch.Tensor | None = None
        self.kv_scales: torch.Tensor | None = None
        # This layer's KV cache group (its block tables), set by the runner.
        self.kv_group = 0
        # Set by the runner when our C++ CPU kernels are loaded (model/cpu_ops.py).
        self.cpu_decode = False

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] -> [T, H * D]."""
        if torch.compiler.is_compiling():
            # Ragged, data-dependent work (per-request loops, gathers by block table):
            # keep it out of the graph so one compiled graph serves every step shape.
            return torch.ops.iterserve.attention(q, k, v, self.layer_idx)
        return self.attend(q, k, v)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = get_forward_context()
        if meta.groups is not None:
            meta = meta.groups[self.kv_group]
        kv = self.kv_cache
        assert kv is not None, "KV cache not bound"
        # A window changes nothing in a step where no context is longer than it.
        window = self.sliding_window or 0
        if window and 0 < meta.max_context_len <= window:
            window = 0
        cap = self.logit_softcap or 0.0
        if (window or cap) and not meta.use_flash and not self._kernels_take(q, meta):
            return windowed_attention(self, q, k, v, kv, meta)
        if self.cpu_decode and meta.num_decode_tokens == 1 and q.shape[0] == 1:
            g = meta.decode_groups[0]
            if self.kv_scales is None:
                return torch.ops.iterserve_cpu.decode_attention(
                    q, k, v, kv, g.block_table, meta.slot_mapping, g.context_len, self.scale,
                    window, cap)
            # 8-bit: the batched paged kernel reads it (the one-token op is float-only).
            self.write_kv(k, v, kv, meta)
            ctx = torch.full((1,), g.context_len, dtype=torch.long)
            return torch.ops.iterserve_cpu.paged_decode_attention(
                q, kv, g.block_table, ctx, self.scale, window, cap, self.kv_scales)
        kc, vc = self.write_kv(k, v, kv, meta)
        t = q.shape[0]
        if meta.use_flash:
            out = flash_attn_varlen_func(
                q.contiguous(),
                kc,
                vc,
                cu_seqlens_q=meta.cu_seqlens_q,
                cu_seqlens_k=meta.cu_seqlens_k,
                max_seqlen_q=meta.max_seqlen_q,
                max_seqlen_k=meta.max_seqlen_k,
                softmax_scale=self.scale,
                causal=True,
                block_table=meta.block_table,
                window_size=(self.sliding_window - 1 if self.sliding_window else -1, 0),
                softcap=self.logit_softcap or 0.0,
            )
            return out.reshape(t, self.num_heads * self.head_dim)

        d = meta.num_decode_tokens
        hidden = self.num_heads * self.head_dim
        if d == t:  # decodes only: no output buffer to stitch into
            return self._decode(q, kv, meta, window, cap).reshape(t, hidden)
        if meta.prefill_block_table is not None:
            pre = torch.ops.iterserve_cpu.prefill_attention(
                q[d:], kv, meta.prefill_block_table, meta.prefill_query_start,
                meta.prefill_computed, self.scale, window, cap, self.kv_scales)
            if not d:
                return pre
            out = torch.empty((t, hidden), dtype=q.dtype, device=q.device)
            out[:d] = self._decode(q[:d], kv, meta, window, cap).view(d, hidden)
            out[d:] = pre
            return out
        if d == 0 and len(meta.prefills) == 1:
            return self._prefill(q, k, v, kv, meta.prefills[0], meta).reshape(t, hidden)
        out = torch.empty_like(q)
        if d:
            out[:d] = self._decode(q[:d], kv, meta)
        for p in meta.prefills:
            out[p.q_start : p.q_end] = self._prefill(q, k, v, kv, p, meta)
        return out.view(t, hidden)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                 meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's K/V into their slots of the paged cache; returns its K and V pools."""
        kc, vc = kv[0], kv[1]
        num_slots = kv.shape[1] * kv.shape[2]
        if self.kv_scales is not None:
            write_rows(kc, self.kv_scales[0], meta.slot_mapping, k)
            write_rows(vc, self.kv_scales[1], meta.slot_mapping, v)
            return kc, vc
        kc.view(num_slots, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, k)
        vc.view(num_slots, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, v)
        return kc, vc

    def read_blocks(self, kv: torch.Tensor, block_ids: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
        """[2, n_blocks * block_size, KVH, D] of the listed blocks' K and V in ``dtype``
        (an 8-bit cache dequantized)."""
        out = kv[:, block_ids].flatten(1, 2)
        if self.kv_scales is None:
            return out
        return dequantize_rows(out, self.kv_scales[:, block_ids].flatten(1, 2), dtype)

    def _gather(
        self, kv: torch.Tensor, block_ids: torch.Tensor, buf: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """[2, n_blocks * block_size, KVH, D] copy of the listed blocks' K and V.

        An 8-bit cache is dequantized to ``dtype`` (``read_blocks``). Else one index_select over whole blocks (contiguous block_size*KVH*D runs) for K
        and V together: several times faster on CPU than advanced indexing slot by
        slot, and one op instead of two (a batch-1 decode step is op-bound)."""
        ids = block_ids.view(-1)
        if self.kv_scales is not None:
            return self.read_blocks(kv, ids, dtype)
        flat = kv.view(2, kv.shape[1], -1)
        if buf is None:
            out = flat.index_select(1, ids)
        else:
            row = flat.shape[2]
            out = torch.index_select(flat, 1, ids, out=buf[: 2 * ids.numel() * row].view(2, -1, row))
        return out.view(2, -1, self.num_kv_heads, self.head_dim)

    def _kernels_take(self, q: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether our C++ kernels run every part of this step (they take a window and
        soft-capping; the torch paths do not)."""
        d = meta.num_decode_tokens
        lone = self.cpu_decode and d == 1 and q.shape[0] == 1
        decodes = d == 0 or lone or meta.decode_block_table is not None
        return decodes and (lone or not meta.prefills or meta.prefill_block_table is not None)

    def _decode(self, q: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata,
                window: int = 0, cap: float = 0.0) -> torch.Tensor:
        if meta.decode_block_table is not None:
            out = torch.ops.iterserve_cpu.paged_decode_attention(
                q, kv, meta.decode_block_table, meta.decode_context_lens, self.scale, window, cap,
                self.kv_scales)
            return out.view(q.shape[0], self.num_heads, self.head_dim)
        groups = meta.decode_groups
        if len(groups) == 1:
            return self._decode_group(q, kv, groups[0], meta)
        out = torch.empty_like(q)
        for g in groups:
            out[g.start : g.end] = self._decode_group(q[g.start : g.end], kv, g, meta)
        return out

    def _decode_group(
        self, q: torch.Tensor, kv: torch.Tensor, g: DecodeGroup, meta: AttentionMetadata
    ) -> torch.Tensor:
        d = q.shape[0]
        kvh, hd = self.num_kv_heads, self.head_dim
        gathered = self._gather(kv, g.block_table, meta.kv_buf, q.dtype).view(2, d, -1, kvh, hd)
        if g.context_len:
            gathered = gathered[:, :, : g.context_len]
        k, v = gathered.transpose(2, 3).unbind(0)  # [d, KVH, L, D] each
        # The `group` query heads sharing a KV head act as `group` queries of length 1.
        qg = q.view(d, kvh, self.group, hd)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=g.mask, scale=self.scale)
        return o.reshape(d, self.num_heads, hd)

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: torch.Tensor,
        p: PrefillChunk,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        s, e = p.q_start, p.q_end
        qs = q[s:e].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if p.num_computed_tokens == 0:
            ks = k[s:e].transpose(0, 1).unsqueeze(0)
            vs = v[s:e].transpose(0, 1).unsqueeze(0)
            if _upcast(qs):
                o = _sdpa_gqa(qs.float(), ks.float(), vs.float(), None, True, self.scale,
                              self.group).to(qs.dtype)
            else:
                o = _sdpa_gqa(qs, ks, vs, None, True, self.scale, self.group)
        elif p.mask is None:
            o = self._prefill_on_prefix(qs, k[s:e], v[s:e], kv, p, meta)
        else:
            ctx = p.num_computed_tokens + (e - s)
            assert p.block_ids is not None, "a chunk on a cached prefix carries its block ids"
            gathered = self._gather(kv, p.block_ids, meta.kv_buf, q.dtype)[:, :ctx]
            ks, vs = gathered.transpose(1, 2).unsqueeze(1).unbind(0)  # [1, KVH, ctx, D]
            o = _sdpa_gqa(qs, ks, vs, p.mask, False, self.scale, self.group)
        return o[0].transpose(0, 1)  # [n, H, D]

    def _prefill_on_prefix(
        self,
        qs: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: torch.Tensor,
        p: PrefillChunk,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Softmax over [prefix | chunk] as two flash calls: the prefix unmasked, the
        chunk's own K/V causally, merged by their log-sum-exps."""
        c = p.num_computed_tokens
        assert p.block_ids is not None, "a chunk on a cached prefix carries its block ids"
        nb = -(-c // kv.shape[2])
        prefix = self._gather(kv, p.block_ids[:nb], meta.kv_buf, qs.dtype)[:, :c]
        kp, vp = prefix.transpose(1, 2).unsqueeze(1).unbind(0)  # [1, KVH, c, D]
        kn = k.transpose(0, 1).unsqueeze(0)
        vn = v.transpose(0, 1).unsqueeze(0)
        qf = qs
        if _upcast(qs):
            qf, kp, vp, kn, vn = qs.float(), kp.float(), vp.float(), kn.float(), vn.float()
        o1, lse1 = _cpu_flash(qf, kp, vp, 0.0, False, scale=self.scale)
        o2, lse2 = _cpu_flash(qf, kn, vn, 0.0, True, scale=self.scale)
        m = torch.maximum(lse1, lse2)
        w1 = (lse1 - m).exp_().unsqueeze(-1)
        w2 = (lse2 - m).exp_().unsqueeze(-1)
        o = (o1.float() * w1).add_(o2.float() * w2).div_(w1 + w2)
        return o.to(qs.dtype)


def _upcast(q: torch.Tensor) -> bool:
    """Whether prefill attention runs in float32 for this bfloat16 step: CPU flash
    attention in bf16 is slower than in float32 without AMX (docs/benchmarks.md), and
    the upcasts cost little beside the quadratic part."""
    return q.dtype == torch.bfloat16 and q.device.type == "cpu"


def _sdpa_gqa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    group: int,
) -> torch.Tensor:
    if group == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)
    if _HAS_ENABLE_GQA:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True
        )
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)


# The cache writes are a side effect on tensors the graph never sees (the layer's
# kv_cache), so the op declares no mutated arguments. Registered through the plain
# torch.library API rather than @custom_op: its Python wrappers cost as much as a
# large share of a batch-1 decode's attention.
_lib = torch.library.Library("iterserve", "FRAGMENT")
_lib.define("attention(Tensor q, Tensor k, Tensor v, int layer_idx) -> Tensor")


def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int) -> torch.Tensor:
    return _layers[layer_idx].attend(q, k, v)


_lib.impl("attention", _attention_op, "CompositeExplicitAutograd")


@torch.library.register_fake("iterserve::attention", lib=_lib)
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int) -> torch.Tensor:
    return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))
