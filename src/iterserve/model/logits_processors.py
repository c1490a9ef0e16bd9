"""Per-request logit edits before sampling: grammar masks (structured outputs),
``logit_bias``, ``allowed_token_ids`` and ``bad_words``. Each returns a new tensor and
touches only the rows of requests that asked for it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from iterserve.core.outputs import GrammarBitmask
from iterserve.core.request import Request


def apply_grammar_bitmask(
    logits: torch.Tensor, reqs: Sequence[Request], grammar: GrammarBitmask
) -> torch.Tensor:
    """Disallowed tokens of the constrained rows -> -inf (a new tensor; other rows as
    they were). A row that allows nothing (a broken grammar) is left unmasked rather
    than turned into NaNs; the grammar's matcher then ends the request."""
    row_of = {r.request_id: i for i, r in enumerate(reqs)}
    pairs = [(row_of[rid], j) for j, rid in enumerate(grammar.request_ids) if rid in row_of]
    if not pairs:
        return logits
    rows = torch.tensor([i for i, _ in pairs], device=logits.device)
    vocab = logits.shape[1]
    # Bits -> bytes in numpy (one pass over the packed words), little-endian as
    # llguidance packs them; ids past the grammar's vocabulary are never allowed.
    words = np.ascontiguousarray(np.asarray(grammar.bitmask)[[j for _, j in pairs]])
    bits = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")[:, :vocab]
    allowed = torch.zeros(len(pairs), vocab, dtype=torch.bool)
    allowed[:, : bits.shape[1]] = torch.from_numpy(bits).view(torch.bool)
    allowed = allowed.to(logits.device)
    allowed |= ~allowed.any(dim=1, keepdim=True)
    if len(pairs) == logits.shape[0] and all(i == k for k, (i, _) in enumerate(pairs)):
        return logits.masked_fill(~allowed, float("-inf"))  # every row: no gather, no scatter
    logits = logits.clone()
    logits[rows] = logits[rows].masked_fill_(~allowed, float("-inf"))
    return logits


class BadWords:
    """A request's bad-word sequences indexed for the per-step check: the last tokens of
    one-token words (always banned), and for longer words, by prefix length, a map from
    prefix to the last tokens it bans. A step looks up one tuple per distinct prefix
    length, whatever the number of words."""

    __slots__ = ("always", "by_prefix")

    def __init__(self, seqs: Sequence[Sequence[int]]) -> None:
        always: set[int] = set()
        by_prefix: dict[int, dict[tuple[int, ...], list[int]]] = {}
        for seq in seqs:
            if len(seq) == 1:
                always.add(seq[0])
            elif seq:
                by_prefix.setdefault(len(seq) - 1, {}).setdefault(tuple(seq[:-1]), []).append(
                    seq[-1])
        self.always = sorted(always)
        self.by_prefix = by_prefix

    def banned(self, out: Sequence[int]) -> list[int]:
        """Tokens that would complete a bad word after output ``out``."""
        ids = list(self.always)
        n = len(out)
        for k, table in self.by_prefix.items():
            if n >= k:
                last = table.get(tuple(out[n - k:]))
                if last:
                    ids.extend(last)
        return ids


def apply_logit_controls(logits: torch.Tensor, reqs: Sequence[Request],
                         bad_words: dict[str, BadWords] | None = None) -> torch.Tensor:
    """``logit_bias`` added, tokens outside ``allowed_token_ids`` and the last token of a
    bad word whose other tokens end the output set to -inf (vLLM's order and meaning).
    ``bad_words`` caches each request's index (its owner drops finished requests)."""
    logits = logits.clone()
    vocab = logits.shape[1]
    neg_inf = float("-inf")
    cache = bad_words if bad_words is not None else {}
    for i, r in enumerate(reqs):
        p = r.sampling_params
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=logits.device)
            bias = torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype,
                                device=logits.device)
            logits[i].index_add_(0, ids, bias)
        if p.allowed_token_ids:
            keep = torch.full((vocab,), neg_inf, dtype=logits.dtype, device=logits.device)
            keep[p.allowed_token_ids] = 0.0
            logits[i] += keep
        if p.bad_words_token_ids:
            index = cache.get(r.request_id)
            if index is None:
                index = cache[r.request_id] = BadWords(p.bad_words_token_ids)
            banned = [t for t in index.banned(r.output_token_ids) if t < vocab]
            if banned:
                logits[i, banned] = neg_inf
    return logits
