"""ModelRunner: the real executor. SchedulerOutput -> one forward pass -> sampled tokens.

Per step: (1) the KV copies the scheduler ordered (swap-out, then swap-in);
(2) flatten every scheduled token into one batch, decodes first, with its
position and KV slot (``block_ids[pos // block_size] * block_size + pos % block_size``);
(3) the model forward under an attention forward context; (4) logits only for
requests whose prefill completes this step; (5) one batched sampler call.

Index tensors are built with numpy in a few vectorised calls per step; Python
loops run over requests, never over tokens.

On CPU, a step of one token (batch-1 decoding) skips all of that: where our C++
kernels build, ``cpu_ops`` ``Decoder`` runs the whole forward for the token in one
call (``ITERSERVE_FUSED_DECODE=0`` turns it off).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import numpy as np
import torch

from iterserve.config import CacheConfig
from iterserve.core.outputs import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from iterserve.core.request import Request
from iterserve.model import cpu_ops
from iterserve.model.attention import (
    AttentionMetadata,
    DecodeGroup,
    PrefillChunk,
    bind_layers,
    flash_available,
    forward_context,
)
from iterserve.model.llama import LlamaForCausalLM
from iterserve.model.model_config import ModelConfig
from iterserve.model.sampler import Sampler

logger = logging.getLogger(__name__)

# On CPU, without an explicit budget, the KV pool takes this share of available RAM...
CPU_KV_RAM_FRACTION = 0.25
# ... but never more than this: the machine is usually shared with other work.
CPU_KV_MAX_BYTES = 4 << 30


def _available_ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def determine_num_gpu_blocks(
    model_config: ModelConfig,
    cache_config: CacheConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    max_num_seqs: int | None = None,
    max_model_len: int | None = None,
) -> int:
    """How many KV blocks the device pool gets; the engine calls this (after the
    weights are loaded) to set ``cache_config.num_gpu_blocks`` before building the
    scheduler. Order: explicit ``num_gpu_blocks``, else ``kv_cache_memory`` bytes,
    else a share of free memory (``gpu_memory_utilization`` of the GPU on CUDA)."""
    if cache_config.num_gpu_blocks is not None:
        return cache_config.num_gpu_blocks
    device = torch.device(device)
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    per_block = model_config.kv_bytes_per_block(cache_config.block_size, dtype_bytes)
    if cache_config.kv_cache_memory is not None:
        budget = cache_config.kv_cache_memory
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        # What we may still use = our share of the card minus what is already in use.
        budget = int(total * cache_config.gpu_memory_utilization) - (total - free)
    else:
        budget = min(int(_available_ram_bytes() * CPU_KV_RAM_FRACTION), CPU_KV_MAX_BYTES)
        if max_num_seqs and max_model_len:
            # More than every sequence at full length is never useful (prefix cache aside).
            need = max_num_seqs * -(-max_model_len // cache_config.block_size)
            budget = min(budget, need * per_block)
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ValueError(
            f"KV cache budget of {budget} bytes holds no block of {per_block} bytes "
            f"(block_size {cache_config.block_size}); raise kv_cache_memory / "
            "gpu_memory_utilization or lower the model size"
        )
    return int(num_blocks)


class ModelRunner:
    """Implements the Executor protocol over a ``LlamaForCausalLM``."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        cache_config: CacheConfig,
        *,
        device: torch.device | str | None = None,
        seed: int = 0,
        compile: bool = False,
    ) -> None:
        self.model = model.eval()
        self.model_config: ModelConfig = model.config
        param = next(model.parameters())
        self.device = torch.device(device) if device is not None else param.device
        self.dtype = param.dtype
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        if cache_config.num_gpu_blocks is None:
            cache_config.num_gpu_blocks = determine_num_gpu_blocks(
                self.model_config, cache_config, self.dtype, self.device
            )
        self.num_gpu_blocks = cache_config.num_gpu_blocks
        mc = self.model_config
        # One tensor for every layer's K and V: [layers, 2, blocks, block_size, kv_heads, head_dim].
        # Zeros, not empty: padded attention reads masked slots, and 0 * NaN garbage is NaN.
        shape = (mc.num_layers, 2, self.num_gpu_blocks, self.block_size, mc.num_kv_heads, mc.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.num_host_blocks = cache_config.swap_space
        self.host_kv_cache: torch.Tensor | None = None
        if self.num_host_blocks:
            host_shape = (*shape[:2], self.num_host_blocks, *shape[3:])
            self.host_kv_cache = torch.zeros(
                host_shape, dtype=self.dtype, pin_memory=self.device.type == "cuda"
            )
        cpu_decode = (
            self.device.type == "cpu"
            and self.dtype in (torch.float32, torch.bfloat16)
            and cpu_ops.available()
        )
        self.cpu_decode = cpu_decode
        for i, layer in enumerate(self.model.model.layers):
            layer.self_attn.attn.kv_cache = self.kv_cache[i]
            layer.self_attn.attn.cpu_decode = cpu_decode
        self.use_flash = flash_available(self.device, self.block_size, self.dtype)
        self.sampler = Sampler(self.device, seed)
        # Gather buffer for attention's K and V, grown on demand and reused every step.
        self._kv_buf = torch.empty(0, dtype=self.dtype, device=self.device)
        # Cumulative swap traffic in blocks (stats and tests).
        self.num_blocks_swapped_out = 0
        self.num_blocks_swapped_in = 0
        self._attn_layers = [layer.self_attn.attn for layer in self.model.model.layers]
        # Any step of one token (batch-1 decode) runs as one C++ call, see cpu_ops.Decoder.
        self.decoder = None
        if cpu_decode and os.environ.get("ITERSERVE_FUSED_DECODE", "1") != "0":
            parts = self.model.decoder_tensors()
            if parts is None:
                logger.info("C++ decoder off: its row-major weight copies would be too large")
            else:
                self.decoder = torch.classes.iterserve_cpu.Decoder(
                    parts[0], parts[1], self.model_config.rms_norm_eps, self.kv_cache
                )
        self.compiled = compile
        self._forward = self.model.model
        if compile:
            self._compile()

    def _compile(self) -> None:
        """torch.compile the decoder stack (inductor), attention left as one opaque op.

        Eager, a step is ~18 small ops a layer (norms, RoPE, SiLU, residual adds)
        around the matmuls, each paying dispatch overhead; inductor fuses them into a
        few C++ loops. Dynamic in the token count: one graph for single-token steps
        (size 1 is specialised; only needed where the C++ decoder does not take them)
        and one for all larger steps, compiled here by warm-up forwards so no request
        pays for it.
        """
        import time

        t0 = time.perf_counter()
        self._forward = torch.compile(self.model.model, dynamic=True, fullgraph=True)
        if not self.use_flash:  # (the fused kernel's metadata differs; it compiles on first use)
            if self.decoder is None:
                self._warmup(1)
            self._warmup(min(16, self.block_size * self.num_gpu_blocks))
        logger.info("compiled the model in %.1f s", time.perf_counter() - t0)

    @torch.inference_mode()
    def _warmup(self, n: int) -> None:
        """One forward over a fresh n-token prompt written into block 0 onwards (at
        start-up every block is free, so nothing cached is overwritten)."""
        dev = self.device
        meta = AttentionMetadata(slot_mapping=torch.arange(n, device=dev))
        if n == 1:
            meta.num_decode_tokens = 1
            table = torch.zeros((1, 1), dtype=torch.long, device=dev)
            meta.decode_groups = [DecodeGroup(0, 1, table, context_len=1)]
            meta.kv_buf = self._gather_buffer(1)
        else:
            meta.prefills = [PrefillChunk(0, n, 0)]
        self._run_model(torch.zeros(n, dtype=torch.long, device=dev), torch.arange(n, device=dev), meta)
        self.kv_cache.zero_()

    def _run_model(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        bind_layers(self._attn_layers)
        with forward_context(meta):
            return self._forward(input_ids, positions)

    # ----------------------------------------------------------------- Executor
    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        so = scheduler_output
        if so.finished_req_ids:
            self.sampler.drop(so.finished_req_ids)
        if so.blocks_to_swap_out:
            self._copy_blocks(so.blocks_to_swap_out, to_host=True)
        if so.blocks_to_swap_in:
            self._copy_blocks(so.blocks_to_swap_in, to_host=False)
        if not so.scheduled_requests:
            return ModelRunnerOutput(sampled_token_ids={})
        if self.decoder is not None and so.num_scheduled_tokens == [1]:
            r, c = so.scheduled_requests[0], so.num_computed_tokens[0]
            sample = c + 1 == r.num_tokens  # a decode, or the last token of a prompt
            args = (r.all_token_ids[c], c, r.block_ids[: c // self.block_size + 1])
            if sample and self.sampler.is_plain_greedy(r):
                token = self.decoder.step_greedy(*args)
                return ModelRunnerOutput(sampled_token_ids={r.request_id: token})
            return self._sample(
                self.decoder.step(*args, sample), [r] if sample else [], so.grammar_bitmask
            )

        inputs = self._prepare(so.scheduled_requests, so.num_scheduled_tokens, so.num_computed_tokens)
        input_ids, positions, meta, sample_idx, sample_reqs = inputs
        hidden = self._run_model(input_ids, positions, meta)
        if not sample_reqs:
            return ModelRunnerOutput(sampled_token_ids={})
        logits = self.model.compute_logits(hidden.index_select(0, sample_idx))
        return self._sample(logits, sample_reqs, so.grammar_bitmask)

    def _sample(
        self, logits: torch.Tensor, sample_reqs: list[Request], grammar: GrammarBitmask | None
    ) -> ModelRunnerOutput:
        if not sample_reqs:
            return ModelRunnerOutput(sampled_token_ids={})
        tokens, logprobs = self.sampler.sample(logits, sample_reqs, grammar)
        sampled = {r.request_id: t for r, t in zip(sample_reqs, tokens)}
        lp = None
        if logprobs is not None:
            lp = {r.request_id: x for r, x in zip(sample_reqs, logprobs) if x is not None}
        return ModelRunnerOutput(sampled_token_ids=sampled, logprobs=lp)

    # ----------------------------------------------------------------- helpers
    def _copy_blocks(self, pairs: list[tuple[int, int]], *, to_host: bool) -> None:
        """Swap copies for all layers in one indexed copy per direction.

        ``pairs`` are (device block, host block) for swap-out and (host block,
        device block) for swap-in, as the scheduler emits them.
        """
        if self.host_kv_cache is None:
            raise RuntimeError("swap requested but swap_space is 0 blocks")
        src_ids = torch.tensor([p[0] for p in pairs], dtype=torch.long)
        dst_ids = torch.tensor([p[1] for p in pairs], dtype=torch.long)
        dev, host = self.kv_cache, self.host_kv_cache
        if to_host:
            self.num_blocks_swapped_out += len(pairs)
            host[:, :, dst_ids] = dev[:, :, src_ids.to(self.device)].to("cpu")
        else:
            self.num_blocks_swapped_in += len(pairs)
            dev[:, :, dst_ids.to(self.device)] = host[:, :, src_ids].to(
                self.device, non_blocking=True
            )

    # Decodes are split into groups of about this many sequences (sorted by context
    # length), each padded only to its own longest context: one SDPA call per group
    # instead of one, but far less padding when context lengths spread widely. 8 beat
    # 16 by ~9% on the decode-heavy benchmark (64 sequences, contexts 64-1024) and 4
    # was no better: padding a slot costs what a real context token does (~3 us per
    # step on the bench model), a group's calls ~200 tokens' worth.
    DECODE_GROUP_SIZE = 8

    def _decode_groups(
        self, table: np.ndarray, nblk: np.ndarray, ctx: np.ndarray
    ) -> list[DecodeGroup]:
        if self.use_flash:
            return []
        d, bs, dev = len(ctx), self.block_size, self.device
        num_groups = -(-d // self.DECODE_GROUP_SIZE)
        bounds = np.linspace(0, d, num_groups + 1).round().astype(int)
        groups = []
        for s, e in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            mb = int(nblk[s:e].max())  # rows are sorted, but be safe
            g = DecodeGroup(s, e, torch.from_numpy(np.ascontiguousarray(table[s:e, :mb])).to(dev))
            if e - s == 1:
                g.context_len = int(ctx[s])  # a lone sequence: trim instead of masking
            else:
                mask = np.arange(mb * bs)[None, :] < ctx[s:e, None]
                g.mask = torch.from_numpy(mask[:, None, None, :]).to(dev)
            groups.append(g)
        return groups

    def _gather_buffer(self, num_blocks: int) -> torch.Tensor:
        mc = self.model_config
        need = 2 * num_blocks * self.block_size * mc.num_kv_heads * mc.head_dim
        if self._kv_buf.numel() < need:
            # Grow with headroom so a slowly growing context does not reallocate every step.
            size = max(need, int(self._kv_buf.numel() * 1.5))
            self._kv_buf = torch.empty(size, dtype=self.dtype, device=self.device)
        return self._kv_buf

    def _causal_mask(self, num_computed: int, n: int) -> torch.Tensor:
        # Query i (absolute position c + i) sees key j iff j <= c + i.
        ctx = num_computed + n
        mask = np.arange(ctx)[None, :] <= (num_computed + np.arange(n))[:, None]
        return torch.from_numpy(mask).to(self.device)

    def _prepare_lone_decode(self, r: Request, c: int):
        """``_prepare`` for a step that is one decode (batch-1 decoding): the same
        tensors in a handful of calls; the general path's numpy work costs ~0.3 ms,
        3% of a batch-1 step on the bench model."""
        bs, dev = self.block_size, self.device
        nb = c // bs + 1
        table = torch.tensor([r.block_ids[:nb]], dtype=torch.long, device=dev)
        slot = r.block_ids[c // bs] * bs + c % bs
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([slot], dtype=torch.long, device=dev),
            num_decode_tokens=1,
            decode_groups=[DecodeGroup(0, 1, table, context_len=c + 1)],
            kv_buf=self._gather_buffer(nb),
        )
        input_ids = torch.tensor([r.all_token_ids[c]], dtype=torch.long, device=dev)
        positions = torch.tensor([c], dtype=torch.long, device=dev)
        sampled = c + 1 == r.num_tokens
        sample_idx = torch.zeros(int(sampled), dtype=torch.long, device=dev)
        return input_ids, positions, meta, sample_idx, [r] if sampled else []

    def _prepare(
        self, reqs: Sequence[Request], num_new: Sequence[int], num_computed: Sequence[int]
    ):
        if len(reqs) == 1 and num_new[0] == 1 and not self.use_flash:
            return self._prepare_lone_decode(reqs[0], num_computed[0])
        bs = self.block_size
        # Decodes (one new token) first, shortest context first, then prefill chunks,
        # each contiguous.
        order = sorted((i for i, n in enumerate(num_new) if n == 1), key=num_computed.__getitem__)
        num_decodes = len(order)
        order += [i for i, n in enumerate(num_new) if n != 1]

        token_ids: list[int] = []
        pos_parts: list[np.ndarray] = []
        slot_parts: list[np.ndarray] = []
        sample_rows: list[int] = []
        sample_reqs: list[Request] = []
        prefills: list[PrefillChunk] = []
        use_flash = self.use_flash
        flash_tables: list[list[int]] = []
        q_lens: list[int] = []
        k_lens: list[int] = []

        # Decodes: vectorised over the group.
        if num_decodes:
            dec = [reqs[i] for i in order[:num_decodes]]
            c = np.fromiter((num_computed[i] for i in order[:num_decodes]), np.int64, num_decodes)
            token_ids.extend(r.all_token_ids[ci] for r, ci in zip(dec, c.tolist()))
            nblk = c // bs + 1
            max_blocks = int(nblk.max())
            table = np.zeros((num_decodes, max_blocks), dtype=np.int64)
            for row, (r, nb) in enumerate(zip(dec, nblk.tolist())):
                table[row, :nb] = r.block_ids[:nb]
            pos_parts.append(c)
            slot_parts.append(table[np.arange(num_decodes), c // bs] * bs + c % bs)
            ctx = c + 1
            decode_groups = self._decode_groups(table, nblk, ctx)
            for row, r in enumerate(dec):
                if num_computed[order[row]] + 1 == r.num_tokens:
                    sample_rows.append(row)
                    sample_reqs.append(r)
            if use_flash:
                flash_tables.extend(r.block_ids[:nb] for r, nb in zip(dec, nblk.tolist()))
                q_lens.extend([1] * num_decodes)
                k_lens.extend(ctx.tolist())

        offset = num_decodes
        for i in order[num_decodes:]:
            r, n, c = reqs[i], num_new[i], num_computed[i]
            token_ids.extend(r.all_token_ids[c : c + n])
            pos = np.arange(c, c + n, dtype=np.int64)
            nb = -(-(c + n) // bs)
            bt = np.asarray(r.block_ids[:nb], dtype=np.int64)
            pos_parts.append(pos)
            slot_parts.append(bt[pos // bs] * bs + pos % bs)
            chunk = PrefillChunk(offset, offset + n, c)
            if c > 0 and not use_flash:
                chunk.block_ids = torch.from_numpy(bt).to(self.device)
                chunk.mask = self._causal_mask(c, n)
            prefills.append(chunk)
            if use_flash:
                flash_tables.append(r.block_ids[:nb])
                q_lens.append(n)
                k_lens.append(c + n)
            offset += n
            if c + n == r.num_tokens:
                sample_rows.append(offset - 1)
                sample_reqs.append(r)

        dev = self.device
        max_gather_blocks = max(
            [g.block_table.numel() for g in decode_groups] if num_decodes and not use_flash else [0]
        )
        max_gather_blocks = max(
            [max_gather_blocks]
            + [p.block_ids.numel() for p in prefills if p.block_ids is not None]
        )
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slot_parts)).to(dev),
            num_decode_tokens=num_decodes,
            prefills=prefills,
        )
        if use_flash:
            meta.use_flash = True
            width = max(len(t) for t in flash_tables)
            bt = np.zeros((len(flash_tables), width), dtype=np.int32)
            for row, t in enumerate(flash_tables):
                bt[row, : len(t)] = t
            meta.block_table = torch.from_numpy(bt).to(dev)
            meta.cu_seqlens_q = torch.tensor(np.cumsum([0, *q_lens]), dtype=torch.int32, device=dev)
            meta.cu_seqlens_k = torch.tensor(np.cumsum([0, *k_lens]), dtype=torch.int32, device=dev)
            meta.max_seqlen_q = max(q_lens)
            meta.max_seqlen_k = max(k_lens)
        elif num_decodes:
            meta.decode_groups = decode_groups
        if max_gather_blocks and not use_flash:
            meta.kv_buf = self._gather_buffer(max_gather_blocks)

        input_ids = torch.tensor(token_ids, dtype=torch.long, device=dev)
        positions = torch.from_numpy(np.concatenate(pos_parts)).to(dev)
        sample_idx = torch.tensor(sample_rows, dtype=torch.long, device=dev)
        return input_ids, positions, meta, sample_idx, sample_reqs
