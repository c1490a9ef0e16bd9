"""Prefill/decode disaggregation, the engine's side: a request's KV blocks out of one
engine's paged cache and into another's (vLLM's KV connector, in miniature).

- **Export** (the prefill engine, vLLM's ``kv_producer``): a request marked with
  ``expect_export`` runs as usual with ``max_tokens=1``; right after the step that
  computes the last of its prompt (the step that samples its first token), before the
  scheduler frees its blocks, the blocks holding the prompt's KV (its full blocks and
  the partial last one) are copied out of the cache tensors into a ``KVBlocks``.
- **Transfer**: ``KVConnector.send_blocks(blocks) -> handle`` and
  ``recv_blocks(handle) -> KVBlocks``; ``LocalKVConnector`` in one process (the handle
  is the blocks), ``cluster.ray_pd.RayKVConnector`` over Ray's object store. A
  transport of bounded messages sends ``to_messages(blocks, max_bytes)``: a small
  ``KVLayout`` and the blocks' bytes cut into messages of at most ``max_bytes`` (a
  block may span several), which ``from_messages`` joins into the same blocks.
- **Import** (the decode engine, ``kv_consumer``): the request is added with its first
  token already in ``all_token_ids`` and ``num_external_computed_tokens`` set to the
  prompt's length, so admission allocates blocks for the prompt and counts it computed
  (core/admission.py); before the step that admits it runs, ``KVTransferExecutor``
  writes the transferred blocks into the blocks just allocated, except those the
  decode engine's own prefix cache supplied (shared with other requests, and holding
  the same KV). The step then computes only the first token's KV and samples the next.

The engine core is untouched: the executor wrapper sits between it and the model
runner, as vLLM's connector hooks sit around its model runner's forward pass.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from iterserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from iterserve.core.request import Request

__all__ = [
    "KVBlocks",
    "KVConnector",
    "KVLayout",
    "KVTransferExecutor",
    "LocalKVConnector",
    "continue_from_kv",
    "from_messages",
    "install",
    "to_messages",
]


@dataclass(slots=True)
class KVBlocks:
    """One request's prompt KV as it travels: ``num_tokens`` positions in
    ``ceil(num_tokens / block_size)`` blocks, every layer's K and V.

    ``kv``: ``[layers, 2, blocks, block_size, kv_heads, head_dim]`` on the host, the
    cache's dtype; ``scales``: the per-row scales of an 8-bit cache (else None).
    """

    num_tokens: int
    block_size: int
    kv: torch.Tensor
    scales: torch.Tensor | None = None

    @property
    def num_blocks(self) -> int:
        return int(self.kv.shape[2])

    @property
    def nbytes(self) -> int:
        n = self.kv.numel() * self.kv.element_size()
        if self.scales is not None:
            n += self.scales.numel() * self.scales.element_size()
        return n

    def check_fits(self, kv_cache: torch.Tensor, block_size: int,
                   scales: torch.Tensor | None) -> None:
        """ValueError, naming what differs, unless these blocks can go into a cache of
        this shape (the two engines must run the same model and cache settings)."""
        if block_size != self.block_size:
            raise ValueError(f"kv_blocks.block_size: {self.block_size} travelled, the "
                             f"engine's block_size is {block_size}")
        want = (kv_cache.shape[0], 2, self.num_blocks, *kv_cache.shape[3:])
        if tuple(self.kv.shape) != tuple(want):
            raise ValueError(f"kv_blocks.kv: shape {tuple(self.kv.shape)}, the engine's "
                             f"cache takes {tuple(want)} (another model?)")
        if self.kv.dtype != kv_cache.dtype:
            raise ValueError(f"kv_blocks.kv: dtype {self.kv.dtype}, the engine's cache is "
                             f"{kv_cache.dtype} (--dtype / --kv-cache-dtype differ)")
        if (self.scales is None) != (scales is None):
            raise ValueError("kv_blocks.scales: one engine's KV cache is 8-bit, the "
                             "other's is not (--kv-cache-dtype differs)")
        if -(-self.num_tokens // self.block_size) != self.num_blocks:
            raise ValueError(f"kv_blocks.num_tokens: {self.num_tokens} tokens do not fill "
                             f"{self.num_blocks} blocks of {self.block_size}")


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What a receiver needs to rebuild ``KVBlocks`` from their bytes: the tensors'
    shapes and dtypes, and how many bytes and messages follow (``to_messages``)."""

    num_tokens: int
    block_size: int
    kv_shape: tuple[int, ...]
    kv_dtype: str
    scales_shape: tuple[int, ...] | None
    scales_dtype: str | None
    nbytes: int
    num_messages: int


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"kv layout: unknown dtype {name!r}")
    return dtype


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def to_messages(blocks: KVBlocks, max_bytes: int) -> tuple[KVLayout, list[torch.Tensor]]:
    """``blocks`` as a layout and uint8 messages of at most ``max_bytes`` each: the K/V
    bytes, then the scales' (an 8-bit cache), cut with no regard for block edges."""
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise ValueError(f"max_message_bytes must be an integer >= 1, got {max_bytes!r}")
    parts = [blocks.kv] if blocks.scales is None else [blocks.kv, blocks.scales]
    flat = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in parts])
    # Each its own copy: a view would serialise (pickle, Ray) its whole storage.
    messages = [m.clone() for m in flat.split(max_bytes)] if flat.numel() else []
    scales = blocks.scales
    layout = KVLayout(
        blocks.num_tokens, blocks.block_size, tuple(blocks.kv.shape), str(blocks.kv.dtype),
        None if scales is None else tuple(scales.shape),
        None if scales is None else str(scales.dtype), int(flat.numel()), len(messages))
    return layout, messages


def from_messages(layout: KVLayout, messages: list[torch.Tensor]) -> KVBlocks:
    """The ``KVBlocks`` that ``to_messages`` cut into ``messages`` (in order); a
    ValueError when they do not add up to what ``layout`` says."""
    if len(messages) != layout.num_messages:
        raise ValueError(f"kv messages: {len(messages)} arrived, the layout names "
                         f"{layout.num_messages}")
    if not all(isinstance(m, torch.Tensor) and m.dtype == torch.uint8 and m.dim() == 1
               for m in messages):
        raise ValueError("kv messages: each must be a 1-D uint8 tensor")
    kv_dtype = _dtype(layout.kv_dtype)
    kv_bytes = _nbytes(layout.kv_shape, kv_dtype)
    scales_bytes = 0
    if layout.scales_shape is not None:
        if layout.scales_dtype is None:
            raise ValueError("kv layout: scales without a dtype")
        scales_dtype = _dtype(layout.scales_dtype)
        scales_bytes = _nbytes(layout.scales_shape, scales_dtype)
    got = sum(int(m.numel()) for m in messages)
    if got != layout.nbytes or kv_bytes + scales_bytes != layout.nbytes:
        raise ValueError(f"kv messages: {got} bytes arrived, the layout's tensors take "
                         f"{kv_bytes + scales_bytes} (it says {layout.nbytes})")
    flat = torch.cat(messages) if messages else torch.empty(0, dtype=torch.uint8)
    kv = flat[:kv_bytes].view(kv_dtype).reshape(layout.kv_shape)
    scales = None
    if layout.scales_shape is not None:
        # (a copy: a view at an odd offset cannot change the element size)
        scales = flat[kv_bytes:].clone().view(scales_dtype).reshape(layout.scales_shape)
    return KVBlocks(layout.num_tokens, layout.block_size, kv, scales)


class KVConnector:
    """How ``KVBlocks`` travel between engines: ``send_blocks`` on the producer's side
    returns a handle (small, picklable), ``recv_blocks`` (or ``recv_blocks_async``) on
    the consumer's side takes it back to the blocks, whatever their size: a transport
    that moves bounded messages splits and joins them itself."""

    def send_blocks(self, blocks: KVBlocks) -> Any:
        raise NotImplementedError

    def recv_blocks(self, handle: Any) -> KVBlocks:
        raise NotImplementedError

    async def recv_blocks_async(self, handle: Any) -> KVBlocks:
        """``recv_blocks`` for an event loop (a decode replica's): a transport that
        waits for the bytes should not block the loop meanwhile."""
        return self.recv_blocks(handle)


class LocalKVConnector(KVConnector):
    """Both engines in one process: the handle is the blocks themselves."""

    def send_blocks(self, blocks: KVBlocks) -> Any:
        return blocks

    def recv_blocks(self, handle: Any) -> KVBlocks:
        if not isinstance(handle, KVBlocks):
            raise ValueError(f"kv handle: expected KVBlocks, got {type(handle).__name__}")
        return handle


class KVTransferExecutor:
    """An executor (a ``ModelRunner``) with export and import around its steps.

    ``expect_export`` / ``take_exported`` and ``expect_import`` / ``forget`` are called
    from the engine's caller (the event loop); ``execute`` runs on the engine thread;
    a lock keeps the three tables consistent between them. Every other attribute is
    the wrapped executor's.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self._lock = threading.Lock()
        self._to_export: set[str] = set()
        self._exported: dict[str, KVBlocks] = {}
        self._to_import: dict[str, KVBlocks] = {}
        # Cumulative, for stats and tests; the seconds are the engine thread's, spent
        # copying KV out of the cache (export) and into it (import).
        self.num_blocks_saved = 0
        self.num_blocks_loaded = 0
        self.num_tokens_saved = 0
        self.num_tokens_loaded = 0
        self.bytes_saved = 0
        self.export_s = 0.0
        self.import_s = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    # -- the caller's side ---------------------------------------------------------------

    def expect_export(self, request_id: str) -> None:
        """Copy ``request_id``'s prompt KV out once its prompt is computed."""
        with self._lock:
            self._to_export.add(request_id)

    def take_exported(self, request_id: str) -> KVBlocks | None:
        """The exported blocks (once), or None if the request never got that far."""
        with self._lock:
            self._to_export.discard(request_id)
            return self._exported.pop(request_id, None)

    def expect_import(self, request_id: str, blocks: KVBlocks) -> None:
        """Write ``blocks`` into ``request_id``'s blocks when it is admitted (its
        ``num_external_computed_tokens`` must be ``blocks.num_tokens``)."""
        runner = self.inner
        blocks.check_fits(runner.kv_cache, runner.block_size, runner.kv_scales)
        with self._lock:
            self._to_import[request_id] = blocks

    def forget(self, request_id: str) -> None:
        """Drop whatever is pending for ``request_id`` (it ended: abort, error)."""
        with self._lock:
            self._to_export.discard(request_id)
            self._exported.pop(request_id, None)
            self._to_import.pop(request_id, None)

    def timings(self) -> dict[str, float]:
        """The cumulative counters: blocks, tokens and bytes moved, seconds copying."""
        return {"num_blocks_saved": self.num_blocks_saved,
                "num_blocks_loaded": self.num_blocks_loaded,
                "num_tokens_saved": self.num_tokens_saved,
                "num_tokens_loaded": self.num_tokens_loaded,
                "bytes_saved": self.bytes_saved,
                "export_s": self.export_s, "import_s": self.import_s}

    @property
    def num_pending(self) -> int:
        with self._lock:
            return len(self._to_export) + len(self._exported) + len(self._to_import)

    # -- the engine thread ------------------------------------------------------------------

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self._to_import:
            self._load(scheduler_output)
        out = self.inner.execute(scheduler_output)
        if self._to_export:
            self._save(scheduler_output, out)
        return out

    def _load(self, so: SchedulerOutput) -> None:
        runner = self.inner
        bs = runner.block_size
        t0 = time.perf_counter()
        for req in so.scheduled_requests:
            with self._lock:
                blocks = self._to_import.pop(req.request_id, None)
            if blocks is None:
                continue
            if req.num_external_computed_tokens != blocks.num_tokens:
                # Preempted by recompute before its first step: it computes its prompt.
                continue
            # Blocks the local prefix cache supplied hold this KV already, and may be
            # read by other requests: only the rest are written.
            first = req.num_cached_tokens // bs
            n = blocks.num_blocks
            if first >= n:
                continue
            dst = torch.tensor(req.block_ids[first:n], dtype=torch.long,
                               device=runner.kv_cache.device)
            runner.kv_cache[:, :, dst] = blocks.kv[:, :, first:n].to(runner.kv_cache.device)
            if runner.kv_scales is not None and blocks.scales is not None:
                runner.kv_scales[:, :, dst] = blocks.scales[:, :, first:n].to(
                    runner.kv_scales.device)
            self.num_blocks_loaded += n - first
            self.num_tokens_loaded += blocks.num_tokens
        self.import_s += time.perf_counter() - t0

    def _save(self, so: SchedulerOutput, out: ModelRunnerOutput) -> None:
        runner = self.inner
        sampled = out.sampled_token_ids
        for req in so.scheduled_requests:
            rid = req.request_id
            if rid not in sampled or rid not in self._to_export:
                continue  # its prompt is not done yet (a chunk), or it is not exported
            t0 = time.perf_counter()
            blocks = export_blocks(runner, req)
            self.export_s += time.perf_counter() - t0
            with self._lock:
                if rid in self._to_export:  # not forgotten meanwhile
                    self._to_export.discard(rid)
                    self._exported[rid] = blocks
                    self.num_blocks_saved += blocks.num_blocks
                    self.num_tokens_saved += blocks.num_tokens
                    self.bytes_saved += blocks.nbytes


def export_blocks(runner: Any, req: Request) -> KVBlocks:
    """The blocks holding ``req``'s prompt KV, copied to the host."""
    bs = runner.block_size
    n = -(-req.num_prompt_tokens // bs)
    src = torch.tensor(req.block_ids[:n], dtype=torch.long, device=runner.kv_cache.device)
    kv = runner.kv_cache[:, :, src].to("cpu")  # indexing copies; then to the host
    scales = None
    if runner.kv_scales is not None:
        scales = runner.kv_scales[:, :, src].to("cpu")
    return KVBlocks(req.num_prompt_tokens, bs, kv, scales)


def install(engine_core: Any) -> KVTransferExecutor:
    """Wrap ``engine_core``'s executor (once) and return the wrapper."""
    executor = engine_core.executor
    if not isinstance(executor, KVTransferExecutor):
        executor = engine_core.executor = KVTransferExecutor(executor)
    return executor


def continue_from_kv(
    op_states: dict[str, Any], first_token_id: int, num_tokens: int, now: float
) -> Callable[[list[Request]], None]:
    """For ``AsyncLLM.add_request(prepare=...)`` on the decode engine: each child
    request continues after ``first_token_id`` (the prefill's), its prompt's KV external.
    The output processor's state for it is advanced over that token as if it had been
    sampled here (detokenizer context, stop-string window, token count), without
    emitting it: the prefill's answer already did."""

    def prepare(requests: list[Request]) -> None:
        for req in requests:
            req.all_token_ids.append(first_token_id)
            req.num_external_computed_tokens = num_tokens
            state = op_states.get(req.request_id)
            if state is None:
                continue
            if state.detokenizer is not None:
                state.detokenizer.update([first_token_id], finished=False)
            state.num_output_tokens = state.num_sent_tokens = 1
            # Its first token was the prefill's: not observed again as a TTFT here.
            state.first_token_time = state.last_token_time = now
            state.num_token_outputs = 1

    return prepare
