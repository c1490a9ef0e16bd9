"""N-gram (prompt lookup) proposer, vLLM's ``method: "ngram"``.

Find the longest n-gram, ``prompt_lookup_min <= n <= prompt_lookup_max``, that ends the
sequence and occurs earlier in it (prompt and output alike); propose the up to ``k``
tokens that followed that earlier occurrence. Among equally long matches the earliest
occurrence wins, as in vLLM V1. No state: each call looks at the sequence it is given.

Vectorised with numpy: candidates are the earlier positions holding the last token, and
each step back narrows them, so a call costs O(candidates * prompt_lookup_max).
"""

from __future__ import annotations

from collections.abc import Sequence
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


class NgramProposer(Proposer):
    method = "ngram"

    def __init__(self, config: SpeculativeConfig, *, max_model_len: int | None = None) -> None:
        super().__init__(config, max_model_len=max_model_len)
        # Filled by SpeculativeConfig.__post_init__ (vLLM's defaults when unset).
        self.min_n = int(config.prompt_lookup_min or 1)
        self.max_n = int(config.prompt_lookup_max or self.min_n)

    def propose(
        self, req_id: str, token_ids: Sequence[int], k: int, num_prompt_tokens: int = 0
    ) -> list[int]:
        if self.max_model_len is not None:
            k = min(k, self.max_model_len - len(token_ids))
        return ngram_propose(token_ids, k, self.min_n, self.max_n)
