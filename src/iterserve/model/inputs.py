"""Step inputs: a SchedulerOutput laid out by ``step_layout`` -> the tensors one forward takes.

Every scheduled token goes into one flat batch, decode rows first (shortest context
first), then prefill chunks, each contiguous, with its position and KV slot
(``block_ids[pos // block_size] * block_size + pos % block_size``); the attention
metadata describes the same layout (the decodes' block table and context lengths, or
decode groups and their padding masks, prefill
chunks and their causal masks, or the varlen kernel's cumulative lengths and block
table); and the rows whose prefill completes this step are the ones sampled.

Index tensors are built with numpy in a few vectorised calls per step; Python loops
run over requests, never over tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from iterserve.core.request import Request
from iterserve.model.attention import (
    AttentionMetadata,
    DecodeGroup,
    PrefillChunk,
    prefix_split_available,
)
from iterserve.model.layers.rotary import LONG_ROPE_OFFSET
from iterserve.model.model_config import ModelConfig
from iterserve.model.step_layout import GROUPED, PAGED, VARLEN, StepLayout, prefill_is_masked


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] long
    positions: torch.Tensor  # [num_tokens] long
    meta: AttentionMetadata
    sample_idx: torch.Tensor  # rows of the batch whose hidden state is sampled
    sample_reqs: list[Request]  # their requests, in the same order
    # Speculative decoding: the rows of requests verifying drafts (all 1 + k positions
    # of each, requests in order), the requests and their drafts.
    spec_idx: torch.Tensor | None = None
    spec_reqs: list[Request] = field(default_factory=list)
    spec_drafts: list[list[int]] = field(default_factory=list)


def decode_groups(
    bounds: Sequence[tuple[int, int]], table: np.ndarray, nblk: np.ndarray, ctx: np.ndarray,
    block_size: int, device: torch.device,
) -> list[DecodeGroup]:
    """The decode rows' attention groups: ``bounds`` from the step's layout, rows
    sorted by context, each group's block table cut to its longest row and, for
    several rows, a mask over the padding (a lone row is trimmed instead)."""
    groups = []
    for s, e in bounds:
        mb = int(nblk[s:e].max())  # rows are sorted, but be safe
        g = DecodeGroup(s, e, torch.from_numpy(np.ascontiguousarray(table[s:e, :mb])).to(device))
        if e - s == 1:
            g.context_len = int(ctx[s])
        else:
            mask = np.arange(mb * block_size)[None, :] < ctx[s:e, None]
            g.mask = torch.from_numpy(mask[:, None, None, :]).to(device)
        groups.append(g)
    return groups


class InputBuilder:
    """Builds ``StepInputs`` for one runner; owns the reusable K/V gather buffer."""

    def __init__(self, model_config: ModelConfig, block_size: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.model_config = model_config
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        # A chunk on a cached prefix attends without a mask here (see attention.py).
        self.prefix_split = prefix_split_available(device)
        # Whether prefill chunks attend in the C++ kernel (set by the runner).
        self.cpu_prefill = False
        # Longrope: requests with prompts beyond this length run on the long factors
        # (their positions offset by LONG_ROPE_OFFSET, see layers/rotary.py).
        self.long_rope_after = model_config.long_rope_after
        # Gather buffer for attention's K and V, grown on demand and reused every step.
        self._kv_buf = torch.empty(0, dtype=dtype, device=device)

    def gather_buffer(self, num_blocks: int) -> torch.Tensor:
        mc = self.model_config
        need = 2 * num_blocks * self.block_size * mc.num_kv_heads * mc.head_dim
        if self._kv_buf.numel() < need:
            # Grow with headroom so a slowly growing context does not reallocate every step.
            size = max(need, int(self._kv_buf.numel() * 1.5))
            self._kv_buf = torch.empty(size, dtype=self.dtype, device=self.device)
        return self._kv_buf

    def causal_mask(self, num_computed: int, n: int) -> torch.Tensor:
        # Query i (absolute position c + i) sees key j iff j <= c + i.
        ctx = num_computed + n
        mask = np.arange(ctx)[None, :] <= (num_computed + np.arange(n))[:, None]
        return torch.from_numpy(mask).to(self.device)

    def build_lone_decode(self, r: Request, c: int, group: int = 0) -> StepInputs:
        """``build`` for a step that is one decode row on the grouped path (batch-1
        decoding without the C++ decoder): the same tensors in a handful of calls; the
        general path's numpy work costs a few percent of such a step."""
        bs, dev = self.block_size, self.device
        nb = c // bs + 1
        ids = r.block_ids if group == 0 else r.block_tables[group]
        table = torch.tensor([ids[:nb]], dtype=torch.long, device=dev)
        slot = ids[c // bs] * bs + c % bs
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([slot], dtype=torch.long, device=dev),
            num_decode_tokens=1,
            decode_groups=[DecodeGroup(0, 1, table, context_len=c + 1)],
            kv_buf=self.gather_buffer(nb),
            max_context_len=c + 1,
        )
        input_ids = torch.tensor([r.all_token_ids[c]], dtype=torch.long, device=dev)
        positions = torch.tensor([c + self.rope_offset(r)], dtype=torch.long, device=dev)
        sampled = c + 1 == r.num_tokens
        sample_idx = torch.zeros(int(sampled), dtype=torch.long, device=dev)
        return StepInputs(input_ids, positions, meta, sample_idx, [r] if sampled else [])

    def rope_offset(self, r: Request) -> int:
        """What this request's positions carry for RoPE (longrope's long-factor mark)."""
        long = self.long_rope_after is not None and r.num_prompt_tokens > self.long_rope_after
        return LONG_ROPE_OFFSET if long else 0

    def build(
        self, step: StepLayout, reqs: Sequence[Request], num_new: Sequence[int],
        num_computed: Sequence[int], spec_tokens: dict[str, list[int]] | None = None,
        group: int = 0,
    ) -> StepInputs:
        """``spec_tokens``: draft tokens by request; such a row (a chunk of ``1 + k``
        tokens: the last token, then the drafts) has every position scored. ``group``:
        the KV cache group whose block tables (``Request.block_tables``) to read."""
        if step.path in (GROUPED, PAGED) and step.num_decodes == 1 and not step.prefill_rows:
            return self.build_lone_decode(reqs[0], num_computed[0], group)
        bs, dev = self.block_size, self.device
        use_flash = step.path == VARLEN
        num_decodes = step.num_decodes

        token_ids: list[int] = []
        pos_parts: list[np.ndarray] = []
        slot_parts: list[np.ndarray] = []
        sample_rows: list[int] = []
        sample_reqs: list[Request] = []
        prefills: list[PrefillChunk] = []
        groups: list[DecodeGroup] = []
        paged_table: torch.Tensor | None = None
        paged_ctx: torch.Tensor | None = None
        flash_tables: list[list[int]] = []
        q_lens: list[int] = []
        k_lens: list[int] = []

        # Decodes: vectorised over the rows.
        if num_decodes:
            rows = step.decode_rows
            dec = [reqs[i] for i in rows]
            c = np.fromiter((num_computed[i] for i in rows), np.int64, num_decodes)
            token_ids.extend(r.all_token_ids[ci] for r, ci in zip(dec, c.tolist()))
            nblk = c // bs + 1
            table = np.zeros((num_decodes, int(nblk.max())), dtype=np.int64)
            for row, (r, nb) in enumerate(zip(dec, nblk.tolist())):
                table[row, :nb] = (r.block_ids if group == 0 else r.block_tables[group])[:nb]
            slot_parts.append(table[np.arange(num_decodes), c // bs] * bs + c % bs)
            if self.long_rope_after is not None:
                c_rope = c + np.fromiter((self.rope_offset(r) for r in dec), np.int64, num_decodes)
                pos_parts.append(c_rope)
            else:
                pos_parts.append(c)
            ctx = c + 1
            max_ctx = int(ctx.max())
            if step.path == PAGED:
                paged_table = torch.from_numpy(table).to(dev)
                paged_ctx = torch.from_numpy(ctx).to(dev)
            else:
                groups = decode_groups(step.decode_groups, table, nblk, ctx, bs, dev)
            for row, (r, ci) in enumerate(zip(dec, c.tolist())):
                if ci + 1 == r.num_tokens:
                    sample_rows.append(row)
                    sample_reqs.append(r)
            if use_flash:
                flash_tables.extend(table[row, :nb].tolist()
                                    for row, nb in enumerate(nblk.tolist()))
                q_lens.extend([1] * num_decodes)
                k_lens.extend(ctx.tolist())
        else:
            max_ctx = 0

        offset = num_decodes
        cpu_prefill = self.cpu_prefill and not use_flash
        prefill_tables: list[np.ndarray] = []
        spec_rows: list[int] = []
        spec_reqs: list[Request] = []
        spec_drafts: list[list[int]] = []
        for i in step.prefill_rows:
            r, n, c0 = reqs[i], num_new[i], num_computed[i]
            drafts = spec_tokens.get(r.request_id) if spec_tokens else None
            if drafts:
                token_ids.extend(r.all_token_ids[c0:])
                token_ids.extend(drafts)
            else:
                token_ids.extend(r.all_token_ids[c0 : c0 + n])
            pos = np.arange(c0, c0 + n, dtype=np.int64)
            nb = -(-(c0 + n) // bs)
            bt = np.asarray((r.block_ids if group == 0 else r.block_tables[group])[:nb],
                            dtype=np.int64)
            slot_parts.append(bt[pos // bs] * bs + pos % bs)
            pos_parts.append(pos + self.rope_offset(r) if self.long_rope_after is not None else pos)
            max_ctx = max(max_ctx, c0 + n)
            chunk = PrefillChunk(offset, offset + n, c0)
            if use_flash:
                flash_tables.append(bt.tolist())
                q_lens.append(n)
                k_lens.append(c0 + n)
            elif cpu_prefill:
                prefill_tables.append(bt)
            elif prefill_is_masked(c0):
                chunk.block_ids = torch.from_numpy(bt).to(dev)
                if not self.prefix_split:
                    chunk.mask = self.causal_mask(c0, n)
            prefills.append(chunk)
            offset += n
            if drafts:
                spec_rows.extend(range(offset - n, offset))
                spec_reqs.append(r)
                spec_drafts.append(drafts)
            elif c0 + n == r.num_tokens:
                sample_rows.append(offset - 1)
                sample_reqs.append(r)

        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slot_parts)).to(dev),
            num_decode_tokens=num_decodes,
            prefills=prefills,
            max_context_len=max_ctx,
        )
        if use_flash:
            meta.use_flash = True
            width = max(len(t) for t in flash_tables)
            table32 = np.zeros((len(flash_tables), width), dtype=np.int32)
            for row, t in enumerate(flash_tables):
                table32[row, : len(t)] = t
            meta.block_table = torch.from_numpy(table32).to(dev)
            meta.cu_seqlens_q = torch.tensor(np.cumsum([0, *q_lens]), dtype=torch.int32, device=dev)
            meta.cu_seqlens_k = torch.tensor(np.cumsum([0, *k_lens]), dtype=torch.int32, device=dev)
            meta.max_seqlen_q = max(q_lens)
            meta.max_seqlen_k = max(k_lens)
        else:
            meta.decode_groups = groups
            meta.decode_block_table = paged_table
            meta.decode_context_lens = paged_ctx
            if prefill_tables:
                self._add_prefill_view(meta, prefill_tables)
            max_gather_blocks = max(
                [g.block_table.numel() for g in groups]
                + [p.block_ids.numel() for p in prefills if p.block_ids is not None]
                + [0]
            )
            if max_gather_blocks:
                meta.kv_buf = self.gather_buffer(max_gather_blocks)

        input_ids = torch.tensor(token_ids, dtype=torch.long, device=dev)
        positions = torch.from_numpy(np.concatenate(pos_parts)).to(dev)
        sample_idx = torch.tensor(sample_rows, dtype=torch.long, device=dev)
        x = StepInputs(input_ids, positions, meta, sample_idx, sample_reqs)
        if spec_reqs:
            x.spec_idx = torch.tensor(spec_rows, dtype=torch.long, device=dev)
            x.spec_reqs, x.spec_drafts = spec_reqs, spec_drafts
        return x

    def _add_prefill_view(self, meta: AttentionMetadata, tables: list[np.ndarray]) -> None:
        """The C++ prefill kernel's tensors for the step's chunks (``meta.prefills``)."""
        dev = self.device
        table = np.zeros((len(tables), max(len(t) for t in tables)), dtype=np.int64)
        for row, t in enumerate(tables):
            table[row, : len(t)] = t
        first = meta.num_decode_tokens
        starts = [p.q_start - first for p in meta.prefills] + [meta.prefills[-1].q_end - first]
        meta.prefill_block_table = torch.from_numpy(table).to(dev)
        meta.prefill_query_start = torch.tensor(starts, dtype=torch.long, device=dev)
        meta.prefill_computed = torch.tensor(
            [p.num_computed_tokens for p in meta.prefills], dtype=torch.long, device=dev)
