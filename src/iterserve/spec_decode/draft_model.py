"""Draft-model proposer, vLLM's ``method: "draft_model"``: a smaller model with the
target's tokenizer guesses ``k`` tokens greedily; the target verifies them in one pass.

The draft runs on iterserve's own ``ModelRunner`` (the same loader, kernels and paged
attention as the target) with a KV cache of its own, managed by a ``KVCacheManager``
without prefix caching. Each request has a mirror ``Request`` here whose
``all_token_ids`` are the target's sequence plus the drafts, and whose
``num_computed_tokens`` says how much of it the draft's cache holds. One call for a
batch of requests is ``k`` draft steps: a catch-up step that computes, per request, the
tokens the draft has not seen (the target's newest sampled token, and any the target
produced that differ from the last drafts), sampling the first draft token; then
``k - 1`` one-token decode steps over the batch. Draft KV of rejected tokens is simply
dropped by winding ``num_computed_tokens`` back to where the drafts and the accepted
sequence part; their slots are overwritten by the next catch-up.

Drafting is greedy, so a draft is a deterministic function of the sequence: with
temperature > 0 the target's rejection sampler treats it as a point mass (as vLLM does
for n-gram drafts), which keeps the target distribution exact.

When the draft cache is full, the least recently used requests not in the batch are
dropped from it (they recompute their context on their next turn).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from iterserve.spec_decode.proposer import DraftRequest, Proposer

if TYPE_CHECKING:
    from iterserve.config_speculative import SpeculativeConfig
    from iterserve.core.request import Request

logger = logging.getLogger(__name__)


class _Mirror:
    """The draft's view of one request."""

    __slots__ = ("prev_len", "req")

    def __init__(self, req: Request) -> None:
        self.req = req
        self.prev_len = 0  # length of the target's sequence at the last call


class DraftModelProposer(Proposer):
    """Greedy drafts from a small model; ``kwargs``: the target's ``dtype``, ``device``,
    ``vocab_size`` (checked against the draft's), ``backend`` (a BackendConfig),
    ``block_size`` and ``num_blocks`` (the draft cache; default: room for
    ``max_num_seqs`` requests of ``max_model_len`` tokens)."""

    method = "draft_model"

    def __init__(self, config: SpeculativeConfig, *, max_model_len: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(config, max_model_len=max_model_len)
        import torch

        from iterserve.config import CacheConfig
        from iterserve.core.kv_cache_manager import KVCacheManager
        from iterserve.model.loader import (
            load_model,
            max_model_len_for,
            model_config_for,
            resolve_device,
            resolve_dtype,
            resolve_model_path,
        )
        from iterserve.model.runner import ModelRunner

        if config.model is None:
            raise ValueError("speculative_config.model is required for method 'draft_model'")
        try:
            path = resolve_model_path(config.model)
        except ValueError as e:
            raise ValueError(f"speculative_config.model: {e}") from None
        device = kwargs.get("device")
        device = torch.device(device) if device is not None else resolve_device("auto")
        draft_cfg = model_config_for(path)
        target_vocab = kwargs.get("vocab_size")
        if target_vocab is not None and draft_cfg.vocab_size != target_vocab:
            raise ValueError(
                f"speculative_config.model {config.model!r} has a vocabulary of "
                f"{draft_cfg.vocab_size} tokens, the target {target_vocab}: a draft model "
                "must share the target's tokenizer")
        dtype = kwargs.get("dtype")
        if dtype is None:
            dtype = resolve_dtype("auto", draft_cfg, device)
        elif isinstance(dtype, str):
            dtype = resolve_dtype(dtype, draft_cfg, device)
        backend = kwargs.get("backend")
        model, mc = load_model(path, dtype, device, backend=backend)
        self.draft_max_len = max_model_len_for(mc)
        if max_model_len is not None:
            self.draft_max_len = min(self.draft_max_len, max_model_len)
        block_size = int(kwargs.get("block_size") or 16)
        num_blocks = kwargs.get("num_blocks")
        if num_blocks is None:
            seqs = int(kwargs.get("max_num_seqs") or 16)
            num_blocks = seqs * -(-(self.draft_max_len + 1) // block_size) + seqs
        self.block_size = block_size
        self.kv = KVCacheManager(int(num_blocks), block_size, enable_caching=False)
        cache = CacheConfig(block_size=block_size, num_gpu_blocks=int(num_blocks),
                            enable_prefix_caching=False)
        # One table per mirror (its KV manager is single-group): no KV cache groups.
        self.runner = ModelRunner(model, cache, device=device, backend=backend,
                                  seed=int(kwargs.get("seed") or 0), kv_cache_groups=False)
        self.model_config = mc
        self.path = path
        # req_id -> mirror, least recently used first.
        self.mirrors: OrderedDict[str, _Mirror] = OrderedDict()
        self._step_id = 0
        logger.info("draft model %s (%.1fM params) with %d KV blocks", path,
                    mc.num_params / 1e6, num_blocks)

    # -- the per-request mirrors ------------------------------------------------------

    def _mirror(self, r: DraftRequest) -> _Mirror:
        from iterserve.core.request import Request
        from iterserve.core.sampling_params import SamplingParams

        m = self.mirrors.get(r.req_id)
        tokens = r.token_ids
        n = len(tokens)
        if m is not None:
            req = m.req
            ids = req.all_token_ids
            p = m.prev_len
            # The target's sequence only grows: what it had at the last call is still
            # its prefix (else the id was reused: start over).
            if p <= n and (p == 0 or ids[p - 1] == tokens[p - 1]):
                # The draft's KV is good up to where drafts and accepted tokens part, and
                # never covers the newest token (its logits give the first draft).
                limit = min(req.num_computed_tokens, n - 1)
                i = min(p, limit)
                while i < limit and ids[i] == tokens[i]:
                    i += 1
                req.num_computed_tokens = i
                del ids[i:]
                ids.extend(tokens[i:])
                m.prev_len = n
                self.mirrors.move_to_end(r.req_id)
                return m
            self._drop(r.req_id)
        sp = SamplingParams(temperature=0.0, max_tokens=1)
        req = Request(r.req_id, list(tokens), sp, 0.0)
        m = self.mirrors[r.req_id] = _Mirror(req)
        m.prev_len = n
        return m

    def _drop(self, req_id: str) -> None:
        m = self.mirrors.pop(req_id, None)
        if m is not None:
            self.kv.free(m.req)
            m.req.num_computed_tokens = 0

    def _reserve(self, m: _Mirror, total: int, keep: set[str]) -> bool:
        """Blocks for ``total`` tokens of ``m``; evicts idle mirrors when short."""
        req = m.req
        need = total - req.num_computed_tokens
        while self.kv.allocate_slots(req, need) is None:
            victim = next((rid for rid in self.mirrors if rid not in keep), None)
            if victim is None:
                return False
            self._drop(victim)
        return True

    # -- drafting -----------------------------------------------------------------------

    def propose(self, req_id: str, token_ids: Sequence[int], k: int,
                num_prompt_tokens: int = 0) -> list[int]:
        return self.propose_batch([DraftRequest(req_id, token_ids, num_prompt_tokens, k)])[0]

    def propose_batch(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        from iterserve.core.outputs import SchedulerOutput

        out: list[list[int]] = [[] for _ in requests]
        keep = {r.req_id for r in requests}
        batch: list[tuple[int, _Mirror, int]] = []  # (index in requests, mirror, k)
        for j, r in enumerate(requests):
            k = min(r.k, self.draft_max_len - len(r.token_ids))
            if k <= 0 or not r.token_ids:
                continue
            m = self._mirror(r)
            # The catch-up computes up to the newest token; k - 1 drafts follow it.
            if self._reserve(m, len(r.token_ids) + k - 1, keep):
                batch.append((j, m, k))
            else:
                self._drop(r.req_id)
        step = 0
        while batch:
            reqs = [m.req for _, m, _ in batch]
            comps = [q.num_computed_tokens for q in reqs]
            nums = [len(q.all_token_ids) - c for q, c in zip(reqs, comps)]
            self._step_id += 1
            total = sum(nums)
            so = SchedulerOutput(self._step_id, reqs, nums, comps, total)
            so.num_decode_tokens = sum(1 for n in nums if n == 1)
            so.num_prefill_tokens = total - so.num_decode_tokens
            so.num_context_tokens = sum(comps) + total
            sampled = self.runner.execute(so).sampled_token_ids
            step += 1
            nxt = []
            for (j, m, k), q, n in zip(batch, reqs, nums):
                q.num_computed_tokens += n
                tok = int(sampled[q.request_id])
                out[j].append(tok)
                q.all_token_ids.append(tok)
                if step < k:
                    nxt.append((j, m, k))
            batch = nxt
        return out

    def on_request_finished(self, req_id: str, token_ids: Sequence[int],
                            num_prompt_tokens: int) -> None:
        self._drop(req_id)

    def reset(self) -> None:
        for rid in list(self.mirrors):
            self._drop(rid)
