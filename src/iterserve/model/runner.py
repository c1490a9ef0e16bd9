"""ModelRunner: the real executor. SchedulerOutput -> one forward pass -> sampled tokens.

Per step: (1) the KV copies the scheduler ordered (swap-out, then swap-in);
(2) the step's layout (``step_layout``: which rows decode, their attention groups,
which path runs) and from it the flat batch of tokens with positions, KV slots and
attention metadata (``inputs``); (3) the model forward under an attention forward
context; (4) logits only for requests whose prefill completes this step; (5) one
batched sampler call.

The kernels come from the backend ``backend.select_backend`` picks (torch, the C++
CPU kernels, or flash-attn on CUDA). With the C++ kernels, a step of one token
(batch-1 decoding) skips all of the above: ``cpu_ops`` ``Decoder`` runs the whole
forward for the token in one call; so does a step of a few rows that are all decodes
or speculative verify runs (``step_layout.DECODER_MAX_ROWS`` tokens at most), its
logits then sampled and verified as the torch path's are. ``step_layout`` (a
``RunnerLayout``) publishes these choices for the simulator's cost model and calibrator.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from iterserve.config import CacheConfig
from iterserve.core.kv_groups import KVCacheGroupSpec, group_size
from iterserve.core.outputs import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from iterserve.core.request import Request
from iterserve.model import cpu_ops, heap, prompt_logprobs, rejection_sampler
from iterserve.model import step_layout as layout_mod
from iterserve.model.attention import (
    AttentionMetadata,
    DecodeGroup,
    PrefillChunk,
    bind_layers,
    forward_context,
)
from iterserve.model.backend import BackendConfig, log_choice, select_backend
from iterserve.model.inputs import InputBuilder
from iterserve.model.kv_cache import (
    copy_blocks,
    determine_num_gpu_blocks,
    hybrid_kv_cache_groups,
)
from iterserve.model.kv_quant import SCALE_DTYPE, cache_dtype_for, is_8bit
from iterserve.model.layers.attention import QKVAttention
from iterserve.model.layers.mlp import GatedMLP
from iterserve.model.layers.norms import RMSNorm
from iterserve.model.linear import Linear, set_gemv_mode, warm_up_multirow
from iterserve.model.model_config import ModelConfig
from iterserve.model.models.base import CausalLM
from iterserve.model.sampler import Sampler
from iterserve.model.step_layout import DECODER, GROUPED, PAGED, VARLEN, RunnerLayout

__all__ = ["ModelRunner", "determine_num_gpu_blocks"]

logger = logging.getLogger(__name__)


class ModelRunner:
    """Implements the Executor protocol over a ``CausalLM`` (any family in model/models).

    ``backend`` (default: ``BackendConfig.from_env()``) picks the kernels; the one the
    runner got is ``self.backend``, and the step layout it follows ``self.step_layout``.
    ``decode_group_size`` overrides ``step_layout.DECODE_GROUP_SIZE``.

    A hybrid model (sliding-window and global layers) gets KV cache groups
    (core/kv_groups.py, ``self.kv_cache_groups``; the scheduler must be built with
    them): one tensor per slot of a group, layer ``j`` of every group on slot ``j``,
    each layer reading its group's block tables. ``kv_cache_groups=False``: one
    tensor per layer, one table (a caller with its own single-table KV manager).
    """

    def __init__(
        self,
        model: CausalLM,
        cache_config: CacheConfig,
        *,
        device: torch.device | str | None = None,
        seed: int = 0,
        compile: bool = False,
        backend: BackendConfig | None = None,
        decode_group_size: int | None = None,
        kv_cache_groups: bool = True,
    ) -> None:
        self.model = model.eval()
        self.model_config: ModelConfig = model.config
        param = next(model.parameters())
        self.device = torch.device(device) if device is not None else param.device
        self.dtype = param.dtype
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        num_gpu_blocks = cache_config.num_gpu_blocks
        if num_gpu_blocks is None:  # an unresolved config: size the pool here
            num_gpu_blocks = determine_num_gpu_blocks(
                self.model_config, cache_config, self.dtype, self.device,
                kv_cache_groups=kv_cache_groups,
            )
        self.num_gpu_blocks = num_gpu_blocks
        mc = self.model_config
        self.kv_cache_groups: list[KVCacheGroupSpec] | None = (
            hybrid_kv_cache_groups(mc) if kv_cache_groups else None)
        # Each layer's slot (its tensor) and group (its block tables).
        layer_slot, layer_group = list(range(mc.num_layers)), [0] * mc.num_layers
        if self.kv_cache_groups is not None:
            for g, spec in enumerate(self.kv_cache_groups):
                for j, layer in enumerate(spec.layers):
                    layer_slot[layer], layer_group[layer] = j, g
        num_slots = (mc.num_layers if self.kv_cache_groups is None
                     else group_size(self.kv_cache_groups))
        # One tensor for every slot's K and V: [slots, 2, blocks, block_size, kv_heads, head_dim]
        # (a slot per layer without groups).
        # Zeros, not empty: padded attention reads masked slots, and 0 * NaN garbage is NaN;
        # the null block of a hybrid cache stays zero.
        shape = (num_slots, 2, self.num_gpu_blocks, self.block_size, mc.num_kv_heads, mc.head_dim)
        # --kv-cache-dtype: 8-bit values plus a per-row scale tensor (model/kv_quant.py).
        self.kv_cache_dtype = cache_dtype_for(cache_config.cache_dtype, self.dtype)
        self.kv_cache = torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
        quantized_kv = is_8bit(self.kv_cache_dtype)
        self.kv_scales: torch.Tensor | None = None
        if quantized_kv:
            self.kv_scales = torch.zeros(shape[:-1], dtype=SCALE_DTYPE, device=self.device)
        self.num_host_blocks = cache_config.swap_space
        self.host_kv_cache: torch.Tensor | None = None
        self.host_kv_scales: torch.Tensor | None = None
        if self.num_host_blocks:
            host_shape = (*shape[:2], self.num_host_blocks, *shape[3:])
            pin = self.device.type == "cuda"
            self.host_kv_cache = torch.zeros(host_shape, dtype=self.kv_cache_dtype, pin_memory=pin)
            if quantized_kv:  # swapped blocks carry their scales
                self.host_kv_scales = torch.zeros(host_shape[:-1], dtype=SCALE_DTYPE,
                                                  pin_memory=pin)
        # Cumulative swap traffic in blocks (stats and tests).
        self.num_blocks_swapped_out = 0
        self.num_blocks_swapped_in = 0

        self.backend_config = backend if backend is not None else BackendConfig.from_env()
        self.backend = select_backend(self.backend_config, self.device, self.dtype, self.block_size)
        log_choice(self.backend)
        cpp = self.backend.cpp_kernels
        self.use_flash = self.backend.flash
        if self.use_flash and quantized_kv:
            # flash-attn reads fp16/bf16 pages; an 8-bit cache takes the torch paths.
            logger.info("flash attention off: the KV cache is %s", cache_config.cache_dtype)
            self.use_flash = False
        self.cpu_decode = cpp
        self._attn_layers = self.model.attention_layers()
        for i, attn in enumerate(self._attn_layers):
            slot = layer_slot[i]
            attn.kv_cache = self.kv_cache[slot]
            attn.kv_scales = None if self.kv_scales is None else self.kv_scales[slot]
            attn.kv_group = layer_group[i]
            attn.cpu_decode = cpp
        # The norms', MLPs' and RoPE's one-pass kernels (norm_act.cpp).
        for m in self.model.modules():
            if isinstance(m, (RMSNorm, GatedMLP, QKVAttention)):
                m.cpu_fused = cpp
        if not cpp:
            # Projections prepared for the C++ GEMV and few-row kernel at load: back to torch.
            for m in self.model.modules():
                if isinstance(m, Linear):
                    m.skinny_weight, m.skinny_rows = None, 0
                    m.pair_weight, m.pair_rows = None, 0
                    if m.gemv_mode == "cpp":
                        set_gemv_mode(m, "plain", 1)
                    if m.quant is not None:
                        m.quant.use_cpp = False
        self.sampler = Sampler(self.device, seed, cpp_argmax=cpp)
        # torch.classes.iterserve_cpu.Decoder (no stubs), or None.
        # (Not with KV cache groups: it reads one tensor per layer through one table.)
        self.decoder: Any = (
            self._make_decoder()
            if cpp and self.backend_config.fused_decode and self.kv_cache_groups is None
            else None)
        if self.decoder is not None and self.kv_scales is not None:
            self.decoder.set_kv_scales(self.kv_scales)  # an 8-bit cache: its per-row scales
        self.step_layout = RunnerLayout(
            block_size=self.block_size,
            attention=VARLEN if self.use_flash else PAGED if cpp else GROUPED,
            decode_group_size=decode_group_size or layout_mod.DECODE_GROUP_SIZE,
            lone_token_path=self.decoder is not None,
            decoder_rows=0,  # timed below, once the torch path is ready to compare
            # The paged decode kernel deals rows whole to torch's threads.
            decode_threads=torch.get_num_threads() if cpp and not self.use_flash else 1,
        )
        self.inputs = InputBuilder(mc, self.block_size, self.device, self.dtype)
        self.inputs.cpu_prefill = (cpp and self.backend_config.prefill_kernel
                                   and cpu_ops.prefill_available(mc.head_dim))
        self.compiled = compile
        self._forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = self.model.model
        if compile:
            self._compile()
        self.step_layout = dataclasses.replace(self.step_layout, decoder_rows=self._decoder_rows())

    def warm_up(self, max_num_seqs: int) -> None:
        """Build the multi-row kernels' per-shape state for every decode batch size up
        to ``max_num_seqs`` now, before any request waits on it (linear.warm_up_multirow)."""
        import time

        t0 = time.perf_counter()
        layers = [m for m in self.model.modules() if isinstance(m, Linear)]
        shapes = warm_up_multirow(layers, min(max_num_seqs, 256))
        if shapes:
            logger.info("warmed %d projection shapes up to %d rows in %.2f s", shapes,
                        min(max_num_seqs, 256), time.perf_counter() - t0)

    def _decoder_rows(self) -> int:
        """Most tokens a few-row step may have on the decoder: as many as it was timed
        faster than the torch path for at load (``_time_decoder_rows``); for
        quantized projections no more rows than their few-row kernel was chosen for at
        load (past that the torch path dequantizes into a GEMM). None on the
        int8-activation kernel: the torch path's kernel for a row count is timed at
        each load, and int8 inputs round apart from float ones, so the two paths would
        not compute the same numbers for the same step."""
        if self.decoder is None:
            return 0
        quants = [m.quant for m in self.model.modules()
                  if isinstance(m, Linear) and m.quant is not None]
        if any(q.act_int8 for q in quants):
            return 0
        # Nor as many as take the int8 GEMM in the torch path (the decoder has no GEMM).
        rows = min([max(layout_mod.DECODER_ROW_CANDIDATES), *(q.few_rows for q in quants),
                    *(q.gemm_rows - 1 for q in quants)])
        if rows <= 1:
            return 0
        pinned = self.backend_config.decoder_rows
        if pinned >= 0:
            rows = min(rows, pinned)
            return rows if rows > 1 else 0
        if self.device.type != "cpu":
            return min(rows, layout_mod.DECODER_MAX_ROWS)
        return self._time_decoder_rows(rows)

    def _make_decoder(self) -> Any:
        """The C++ decoder that runs any step of one token in one call (``cpu_ops``)."""
        parts = self.model.decoder_tensors()
        if parts is None:
            logger.info("C++ decoder off: not this model's layer, or its row-major weight "
                        "copies would be too large")
            return None
        tensors, dims, quant = parts
        if quant and not cpu_ops.quant_available():
            logger.info("C++ decoder off: quantized projections need the AVX-512 kernels")
            return None
        decoder = torch.classes.iterserve_cpu.Decoder(
            tensors, dims, self.model_config.rms_norm_eps, self.kv_cache)
        for slot, qtensors, meta in quant:
            decoder.set_quant(slot, qtensors, meta)
        logger.info("one-token steps run on the C++ decoder%s",
                    f" ({len(quant)} quantized projections)" if quant else "")
        self._pack_decoder(decoder, tensors)
        return decoder

    @staticmethod
    def _pack_decoder(decoder: Any, tensors: list[torch.Tensor]) -> None:
        """bf16 weights on a CPU with AVX512_BF16: a copy of each projection in 16-row
        blocks of element pairs (``csrc/few_rows_bf16.cpp``), where ``vdpbf16ps`` sums
        16 output rows at once with no horizontal sums, for every step the decoder
        runs (one row or a few: a verify run, a handful of decodes). The copy costs
        the projections' bytes again, so only within ``PACKED_WEIGHTS_MAX_BYTES``."""
        from iterserve.model.linear import PACKED_WEIGHTS_MAX_BYTES

        if cpu_ops.FEW_ROWS_BF16_PACKED not in cpu_ops.few_rows_kernels():
            return
        # The projections are the 2-D tensors after the embedding.
        nbytes = sum(t.numel() * t.element_size() for t in tensors[1:]
                     if t.dim() == 2 and t.dtype == torch.bfloat16)
        if not nbytes or nbytes > PACKED_WEIGHTS_MAX_BYTES:
            return
        packed = decoder.pack_bf16()
        if packed:
            decoder.set_kernel(cpu_ops.FEW_ROWS_BF16_PACKED)
            logger.info("C++ decoder: bf16 projections packed for vdpbf16ps (%.1f MiB)",
                        packed / 2**20)

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
            if not self.step_layout.lone_token_path:
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
            meta.kv_buf = self.inputs.gather_buffer(1)
        else:
            meta.prefills = [PrefillChunk(0, n, 0)]
        self._run_model(torch.zeros(n, dtype=torch.long, device=dev), torch.arange(n, device=dev), meta)
        self._clear_kv()

    def _clear_kv(self) -> None:
        self.kv_cache.zero_()
        if self.kv_scales is not None:
            self.kv_scales.zero_()

    @torch.inference_mode()
    def _time_decoder_rows(self, cap: int) -> int:
        """The most rows (of ``DECODER_ROW_CANDIDATES``, at most ``cap``) for which the
        C++ decoder's few-row step, timed here at load, costs no more than the torch
        path's forward over as many tokens: how far the decoder's kernel (the CPU's
        and the model's) keeps ahead of the batched GEMMs. Stops at the first row
        count it loses, and where timing would hold up the start
        (``DECODER_TIMING_BUDGET_S``), keeps ``DECODER_MAX_ROWS``."""
        import time

        from iterserve.model.linear import _best_time

        bs = self.block_size

        def best_of(fn: Callable[[], object]) -> float:
            return _best_time(fn, 3)  # (its first call, a shape's first use, not timed)

        start = time.perf_counter()
        chosen = 0
        timings = []
        for rows in (r for r in layout_mod.DECODER_ROW_CANDIDATES if r <= cap):
            if rows > bs * self.num_gpu_blocks:
                break
            if time.perf_counter() - start > layout_mod.DECODER_TIMING_BUDGET_S:
                chosen = max(chosen, min(cap, layout_mod.DECODER_MAX_ROWS))
                break
            # One request's positions 0..rows-1 (a verify run's shape), blocks 0 onwards.
            positions = list(range(rows))
            tables: list[int] = []
            starts = [0]
            for p in positions:
                tables.extend(range(p // bs + 1))
                starts.append(len(tables))
            tokens = [0] * rows
            t_dec = best_of(functools.partial(self.decoder.step_rows, tokens, positions, tables, starts))
            t_torch = best_of(functools.partial(self._torch_rows, rows))
            timings.append(f"{rows}: {t_dec * 1e3:.2f} / {t_torch * 1e3:.2f} ms")
            if t_dec > t_torch:
                break
            chosen = rows
        self._clear_kv()
        logger.info("C++ decoder takes steps of up to %d rows (decoder / torch path, timed: %s)",
                    chosen, "; ".join(timings) or "-")
        return chosen if chosen > 1 else 0

    def _torch_rows(self, rows: int) -> None:
        """The torch path's forward and logits over ``rows`` fresh tokens (block 0 on)."""
        dev = self.device
        meta = AttentionMetadata(slot_mapping=torch.arange(rows, device=dev))
        meta.prefills = [PrefillChunk(0, rows, 0)]
        hidden = self._run_model(torch.zeros(rows, dtype=torch.long, device=dev),
                                 torch.arange(rows, device=dev), meta)
        self.model.compute_logits(hidden)

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
        spec = so.scheduled_spec_decode_tokens
        drafts = ([len(spec.get(r.request_id, ())) for r in so.scheduled_requests]
                  if spec else None)
        step = self.step_layout.plan(so.num_scheduled_tokens, so.num_computed_tokens, drafts)
        plp = prompt_logprobs.wanted(so)
        if step.path == DECODER and plp:  # prompt logprobs need the step's hidden states
            no_lone = dataclasses.replace(self.step_layout, lone_token_path=False, decoder_rows=0)
            step = no_lone.plan(so.num_scheduled_tokens, so.num_computed_tokens)
        if step.path == DECODER and (len(step.order) > 1 or drafts):
            return self._decode_rows(so, step.order)
        if step.path == DECODER:
            r, c = so.scheduled_requests[0], so.num_computed_tokens[0]
            sample = c + 1 == r.num_tokens  # a decode, or the last token of a prompt
            args = (r.all_token_ids[c], c, r.block_ids[: c // self.block_size + 1])
            if sample and self.sampler.is_plain_greedy(r):
                token = self.decoder.step_greedy(*args)
                return ModelRunnerOutput(sampled_token_ids={r.request_id: token})
            return self._sample(
                self.decoder.step(*args, sample), [r] if sample else [], so.grammar_bitmask
            )

        x = self.inputs.build(step, so.scheduled_requests, so.num_scheduled_tokens,
                              so.num_computed_tokens, so.scheduled_spec_decode_tokens)
        if self.kv_cache_groups is not None:
            # The same layout over each group's block tables; each layer reads its own.
            x.meta.groups = [x.meta] + [
                self.inputs.build(step, so.scheduled_requests, so.num_scheduled_tokens,
                                  so.num_computed_tokens, so.scheduled_spec_decode_tokens,
                                  group=g).meta
                for g in range(1, len(self.kv_cache_groups))
            ]
        hidden = self._run_model(x.input_ids, x.positions, x.meta)
        if plp:
            prompt_logprobs.record(self.model, so, hidden, plp)
        if not x.sample_reqs:
            out = ModelRunnerOutput(sampled_token_ids={})
        else:
            logits = self.model.compute_logits(hidden.index_select(0, x.sample_idx))
            out = self._sample(logits, x.sample_reqs, so.grammar_bitmask)
        if x.spec_idx is not None:
            self._verify(out, hidden.index_select(0, x.spec_idx), x.spec_reqs, x.spec_drafts)
        if self.device.type == "cpu" and len(x.input_ids) >= heap.TRIM_AFTER_TOKENS:
            del hidden, x
            heap.malloc_trim()  # the step's activations out of RSS (model/heap.py)
        return out

    def _decode_rows(self, so: SchedulerOutput, order: list[int]) -> ModelRunnerOutput:
        """A few-row step on the C++ decoder: one row per token (a decode, a lone
        prompt token, or each position of a verify run), the rows in ``order`` (the
        PAGED path's), all their logits back; then sampled and verified as there."""
        bs = self.block_size
        spec = so.scheduled_spec_decode_tokens
        tokens: list[int] = []
        positions: list[int] = []
        tables: list[int] = []
        starts = [0]
        sample_rows: list[int] = []
        sample_reqs: list[Request] = []
        spec_rows: list[int] = []
        spec_firsts: list[int] = []
        spec_reqs: list[Request] = []
        spec_drafts: list[list[int]] = []
        for i in order:
            r, c = so.scheduled_requests[i], so.num_computed_tokens[i]
            d = spec.get(r.request_id) if spec else None
            first = len(tokens)
            tokens.append(r.all_token_ids[c])
            if d:
                tokens.extend(d)
                spec_rows.extend(range(first, len(tokens)))
                spec_firsts.append(first)
                spec_reqs.append(r)
                spec_drafts.append(d)
            elif c + 1 == r.num_tokens:  # a decode, or a prompt's last token
                sample_rows.append(first)
                sample_reqs.append(r)
            table = r.block_ids[: (c + len(tokens) - first - 1) // bs + 1]
            for j in range(len(tokens) - first):
                positions.append(c + j)
                tables.extend(table)
                starts.append(len(tables))
        if all(self.sampler.is_plain_greedy(so.scheduled_requests[i]) for i in order):
            # Only the picks come back (argmax in C++, as for a lone greedy token).
            ids = self.decoder.step_rows_greedy(tokens, positions, tables, starts)
            out = ModelRunnerOutput(
                sampled_token_ids={r.request_id: ids[row] for r, row in zip(sample_reqs, sample_rows)})
            if spec_reqs:
                out.accepted_draft_token_ids = {}
                for r, first, d in zip(spec_reqs, spec_firsts, spec_drafts):
                    a = rejection_sampler.greedy_accepted(d, ids[first : first + len(d) + 1])
                    out.sampled_token_ids[r.request_id] = ids[first + a]
                    out.accepted_draft_token_ids[r.request_id] = d[:a]
            return out
        logits = self.decoder.step_rows(tokens, positions, tables, starts)
        if not sample_rows:
            out = ModelRunnerOutput(sampled_token_ids={})
        elif len(sample_rows) == logits.shape[0]:
            out = self._sample(logits, sample_reqs, so.grammar_bitmask)
        else:
            out = self._sample(logits[sample_rows], sample_reqs, so.grammar_bitmask)
        if spec_reqs:
            self._verify_logits(out, logits[spec_rows], spec_reqs, spec_drafts)
        return out

    def _verify(self, out: ModelRunnerOutput, hidden: torch.Tensor, reqs: list[Request],
                drafts: list[list[int]]) -> None:
        """Speculative decoding: score every position of the verifying requests in
        one logits call, and rejection-sample their drafts (``rejection_sampler``)."""
        self._verify_logits(out, self.model.compute_logits(hidden), reqs, drafts)

    def _verify_logits(self, out: ModelRunnerOutput, logits: torch.Tensor, reqs: list[Request],
                       drafts: list[list[int]]) -> None:
        v = rejection_sampler.verify(self.sampler, logits, reqs, drafts)
        out.sampled_token_ids.update(v.sampled)
        out.accepted_draft_token_ids = v.accepted
        if v.logprobs:
            if out.logprobs is None:
                out.logprobs = {}
            out.logprobs.update(v.logprobs)
            out.accepted_draft_logprobs = v.accepted_logprobs

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

    def _copy_blocks(self, pairs: list[tuple[int, int]], *, to_host: bool) -> None:
        if self.host_kv_cache is None:
            raise RuntimeError("swap requested but swap_space is 0 blocks")
        copy_blocks(self.kv_cache, self.host_kv_cache, pairs, to_host=to_host)
        if self.kv_scales is not None:
            assert self.host_kv_scales is not None
            copy_blocks(self.kv_scales, self.host_kv_scales, pairs, to_host=to_host)
        if to_host:
            self.num_blocks_swapped_out += len(pairs)
        else:
            self.num_blocks_swapped_in += len(pairs)
