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


def apply_logit_controls(logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
    """``logit_bias`` added, tokens outside ``allowed_token_ids`` and the last token of a
    bad word whose other tokens end the output set to -inf (vLLM's order and meaning)."""
    logits = logits.clone()
    vocab = logits.shape[1]
    neg_inf = float("-inf")
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
            out = r.output_token_ids
            for seq in p.bad_words_token_ids:
                k = len(seq) - 1
                if k == 0 or (len(out) >= k and out[len(out) - k:] == seq[:k]):
                    logits[i, seq[-1]] = neg_inf
    return logits
