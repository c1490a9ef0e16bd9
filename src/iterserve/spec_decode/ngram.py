"""N-gram (prompt lookup) proposer, vLLM's ``method: "ngram"``.

Find the longest n-gram, ``prompt_lookup_min <= n <= prompt_lookup_max``, that ends the
sequence and occurs earlier in it (prompt and output alike); propose the up to ``k``
tokens that followed that earlier occurrence. Among equally long matches the earliest
occurrence wins, as in vLLM V1.

``ngram_propose`` states the rule on a whole sequence, vectorised with numpy
(candidates are the earlier positions holding the last token, each step back narrows
them: O(candidates * prompt_lookup_max) a call). The proposer gives the same answer
from an index it keeps per request instead: every n-gram of the sequence (n in the
lookup range) mapped to where it first ends, extended by the tokens each call adds,
so a step costs a few dictionary lookups however long the sequence is (a step of a
small model lasts a fraction of a millisecond: a scan of the whole sequence per step
is a visible share of it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from iterserve.spec_decode.proposer import Proposer

if TYPE_CHECKING:
    from iterserve.config_speculative import SpeculativeConfig


def ngram_propose(
    token_ids: Sequence[int] | np.ndarray, k: int, min_n: int, max_n: int
) -> list[int]:
    """The prompt-lookup rule as a function (tested directly and by the proposer)."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    t = tokens.shape[0]
    if k <= 0 or t < min_n + 1:
        return []
    # End positions j < t - 1 of earlier occurrences of the last token.
    ends = np.flatnonzero(tokens[: t - 1] == tokens[t - 1])
    if ends.size == 0:
        return []
    length = np.ones(ends.shape[0], dtype=np.int64)
    alive = np.ones(ends.shape[0], dtype=bool)
    for d in range(1, min(max_n, t - 1)):
        idx = ends - d
        ok = alive & (idx >= 0)
        ok[ok] = tokens[idx[ok]] == tokens[t - 1 - d]
        if not ok.any():
            break
        length += ok
        alive = ok
    best = int(length.max())
    if best < min_n:
        return []
    start = int(ends[int(np.argmax(length == best))]) + 1  # the earliest longest match
    return tokens[start : min(start + k, t)].tolist()


@dataclass(slots=True)
class _Index:
    """One request's n-grams: each (as a tuple) -> the position where it first ends,
    over the n-grams ending before position ``upto`` (the last token's n-grams are not
    in it: a match must occur earlier)."""

    first_end: dict[tuple[int, ...], int] = field(default_factory=dict)
    upto: int = 0


class NgramProposer(Proposer):
    method = "ngram"

    def __init__(self, config: SpeculativeConfig, *, max_model_len: int | None = None) -> None:
        super().__init__(config, max_model_len=max_model_len)
        # Filled by SpeculativeConfig.__post_init__ (vLLM's defaults when unset).
        self.min_n = int(config.prompt_lookup_min or 1)
        self.max_n = int(config.prompt_lookup_max or self.min_n)
        self._index: dict[str, _Index] = {}

    def propose(
        self, req_id: str, token_ids: Sequence[int], k: int, num_prompt_tokens: int = 0
    ) -> list[int]:
        if self.max_model_len is not None:
            k = min(k, self.max_model_len - len(token_ids))
        tokens = token_ids.tolist() if isinstance(token_ids, np.ndarray) else token_ids
        t = len(tokens)
        if k <= 0 or t < self.min_n + 1:
            return []
        index = self._index.get(req_id)
        if index is None or index.upto > t - 1:  # new, or not the sequence it indexed
            index = self._index[req_id] = _Index()
        first_end = index.first_end
        lo, hi = self.min_n, self.max_n
        for j in range(index.upto, t - 1):  # the n-grams ending at j, each kept once
            for n in range(lo, min(hi, j + 1) + 1):
                first_end.setdefault(tuple(tokens[j - n + 1 : j + 1]), j)
        index.upto = t - 1
        for n in range(min(hi, t - 1), lo - 1, -1):  # the longest match first
            end = first_end.get(tuple(tokens[t - n :]))
            if end is not None:
                return list(tokens[end + 1 : min(end + 1 + k, t)])
        return []

    def on_request_finished(
        self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int
    ) -> None:
        self._index.pop(req_id, None)

    def reset(self) -> None:
        self._index.clear()
