"""Suffix decoding, vLLM's ``method: "suffix"`` (SuffixDecoding, arXiv 2411.04975;
the ``suffix_decoding_*`` options of vLLM / Arctic Inference).

Two kinds of suffix tree (``suffix_tree.py``) answer each request's draft:

- a *local* tree per running request over its own prompt and output, so text the
  request repeats (a function it edits, a passage it quotes) is proposed back;
- one *global* tree over the outputs of recent requests, bounded to
  ``suffix_decoding_max_cached_requests`` of them (the oldest is evicted first; 0
  turns it off), so what earlier requests generated is proposed to later ones.

Both are updated with the tokens a request gained since the last call (no rebuilding),
and the draft with the higher score wins. The draft length adapts per request: a match
of ``m`` tokens may propose ``m * suffix_decoding_max_spec_factor`` tokens, and a token
whose estimated probability (its continuation's share of the matched occurrences) falls
below ``suffix_decoding_min_token_prob`` ends the draft.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from iterserve.spec_decode.proposer import Proposer
from iterserve.spec_decode.suffix_tree import Draft, SuffixTree

if TYPE_CHECKING:
    from iterserve.config_speculative import SpeculativeConfig


class SuffixCache:
    """The local trees of active requests and the global tree of recent outputs."""

    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 10000) -> None:
        if max_tree_depth < 1:
            raise ValueError(
                f"speculative_config.suffix_decoding_max_tree_depth must be >= 1, "
                f"got {max_tree_depth}")
        if max_cached_requests < 0:
            raise ValueError(
                f"speculative_config.suffix_decoding_max_cached_requests must be >= 0, "
                f"got {max_cached_requests}")
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.global_tree = SuffixTree(max_tree_depth)
        # req_id -> (its local tree, tokens of prompt + output added so far).
        self.local: dict[str, tuple[SuffixTree, list[int]]] = {}
        # req_id -> sequence id in the global tree, oldest first (dicts keep order).
        self.cached: dict[str, int] = {}
        self._next_seq = 0

    @property
    def active_requests(self) -> set[str]:
        return set(self.local)

    def start_request(self, req_id: str, prompt_token_ids: Sequence[int]) -> None:
        if req_id in self.local:
            raise ValueError(f"request {req_id!r} is already active in the suffix cache")
        tree = SuffixTree(self.max_tree_depth)
        tree.extend(0, prompt_token_ids)
        self.local[req_id] = (tree, list(prompt_token_ids))
        if self.max_cached_requests:
            if req_id in self.cached:  # a reused id: its old output goes
                self.evict(req_id)
            self.cached[req_id] = self._next_seq
            self._next_seq += 1
            while len(self.cached) > self.max_cached_requests:
                self.evict(next(iter(self.cached)))

    def add_tokens(self, req_id: str, token_ids: Sequence[int]) -> None:
        """Output tokens ``req_id`` gained: into its local tree, and into the global
        tree while its output is cached there."""
        tree, seen = self.local[req_id]
        tree.extend(0, token_ids)
        seen.extend(token_ids)
        seq = self.cached.get(req_id)
        if seq is not None:
            self.global_tree.extend(seq, token_ids)

    def stop_request(self, req_id: str) -> None:
        """Drop the local tree; the output stays in the global tree until evicted."""
        self.local.pop(req_id, None)

    def evict(self, req_id: str) -> None:
        seq = self.cached.pop(req_id)
        if seq in self.global_tree:
            self.global_tree.remove(seq)

    def speculate(self, req_id: str, context: Sequence[int], max_spec_tokens: int,
                  max_spec_factor: float = 1.0, min_token_prob: float = 0.1) -> Draft:
        pattern = context[-self.max_tree_depth:]
        best = self.local[req_id][0].speculate(
            pattern, max_spec_tokens, max_spec_factor, min_token_prob)
        if self.global_tree.num_tokens:
            d = self.global_tree.speculate(pattern, max_spec_tokens, max_spec_factor,
                                           min_token_prob)
            if d.score > best.score:
                best = d
        return best


class SuffixProposer(Proposer):
    """A :class:`SuffixCache` kept in step with the sequences the engine passes in."""

    method = "suffix"

    def __init__(self, config: SpeculativeConfig, *, max_model_len: int | None = None,
                 **kwargs: object) -> None:
        super().__init__(config, max_model_len=max_model_len)
        self.cache = SuffixCache(config.suffix_decoding_max_tree_depth,
                                 config.suffix_decoding_max_cached_requests)
        self.max_spec_factor = config.suffix_decoding_max_spec_factor
        self.min_token_prob = config.suffix_decoding_min_token_prob

    def _sync(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        entry = self.cache.local.get(req_id)
        if entry is not None:
            seen = entry[1]
            n = len(seen)
            # Sequences only grow; a shorter or different one is a new request that
            # reused the id (or a request restarted): begin again.
            if len(token_ids) >= n and (n == 0 or token_ids[n - 1] == seen[-1]):
                if len(token_ids) > n:
                    self.cache.add_tokens(req_id, list(token_ids[n:]))
                return
            self.cache.stop_request(req_id)
        p = num_prompt_tokens if 0 < num_prompt_tokens <= len(token_ids) else len(token_ids)
        self.cache.start_request(req_id, list(token_ids[:p]))
        if len(token_ids) > p:
            self.cache.add_tokens(req_id, list(token_ids[p:]))

    def propose(self, req_id: str, token_ids: Sequence[int], k: int,
                num_prompt_tokens: int = 0) -> list[int]:
        self._sync(req_id, token_ids, num_prompt_tokens)
        if self.max_model_len is not None:
            k = min(k, self.max_model_len - len(token_ids))
        if k <= 0:
            return []
        d = self.cache.speculate(req_id, token_ids, k, self.max_spec_factor,
                                 self.min_token_prob)
        return d.token_ids

    def on_request_finished(self, req_id: str, token_ids: Sequence[int],
                            num_prompt_tokens: int) -> None:
        if req_id in self.cache.local:
            # Output the engine never asked drafts for (the last steps) still counts.
            self._sync(req_id, token_ids, num_prompt_tokens)
            self.cache.stop_request(req_id)

    def reset(self) -> None:
        c = self.cache
        self.cache = SuffixCache(c.max_tree_depth, c.max_cached_requests)
