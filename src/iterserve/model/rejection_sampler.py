"""Verifying draft tokens (speculative decoding): the target model's scores for the
``1 + k`` positions of each request decide how many of its ``k`` drafts stand.

Row ``j`` of a request's block (``j = 0 .. k``) holds the logits after the request's
last token and its first ``j`` drafts, i.e. the target distribution ``p_j`` of the
token at draft position ``j``.

- Greedy: draft ``j`` is accepted while it equals ``argmax p_j``; the first mismatch
  is replaced by the argmax, and when all ``k`` stand the bonus token is
  ``argmax p_k``. The output is token for token what decoding without drafts gives.
- Random: drafts are treated as one-hot proposals (exact for any proposer, since a
  draft depends only on the tokens so far): draft ``j`` stands with probability
  ``p_j(d_j)``; on rejection the token is drawn from the residual ``p_j`` with
  ``d_j`` removed, renormalised; after ``k`` accepted drafts the bonus is drawn from
  ``p_k``. Each emitted token then has exactly the target distribution
  (Leviathan et al. 2023, with ``q`` one-hot). ``p_j`` is what the sampler samples
  from (``sampler.target_probs``: temperature, top-k / top-p, min-p).

Seeded requests draw their uniforms and noise from their own generator. Logprobs are
the raw model's, as for plain sampling. Requests with penalties, bad words, grammars
or ``min_tokens`` still ahead never get drafts (``core.spec_decode.eligible``), so the
history-dependent logits processors are not needed here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from iterserve.core.outputs import TokenLogprobs
from iterserve.core.request import Request
from iterserve.model.logits_processors import apply_logit_controls
from iterserve.model.sampler import Sampler, _logprobs, argmax, target_probs


@dataclass(slots=True)
class VerifyOutput:
    sampled: dict[str, int] = field(default_factory=dict)  # the bonus / correction token
    accepted: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # of ``sampled``
    accepted_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


def verify(
    sampler: Sampler, logits: torch.Tensor, reqs: Sequence[Request], drafts: Sequence[list[int]]
) -> VerifyOutput:
    """``logits`` [sum(1 + k_i), vocab] float32, request blocks in order."""
    out = VerifyOutput()
    params = [r.sampling_params for r in reqs]
    starts: list[int] = []
    row_reqs: list[Request] = []
    for r, d in zip(reqs, drafts):
        starts.append(len(row_reqs))
        row_reqs.extend([r] * (len(d) + 1))
    raw = logits
    if any(p.has_logit_controls for p in params):
        logits = apply_logit_controls(logits, row_reqs, sampler.bad_words)
    greedy = [p.is_greedy for p in params]
    targets = argmax(logits, sampler.cpp_argmax).tolist() if any(greedy) else []
    probs: torch.Tensor | None = None
    if not all(greedy):
        row_params = [r.sampling_params for r in row_reqs]
        row_greedy = [p.is_greedy for p in row_params]
        probs = target_probs(logits, row_params, row_greedy)
        probs = probs / probs.sum(dim=-1, keepdim=True)

    emitted: list[tuple[int, list[int]]] = []  # (request index, tokens) for logprobs
    for i, (r, d) in enumerate(zip(reqs, drafts)):
        s, k = starts[i], len(d)
        if greedy[i]:
            a = 0
            while a < k and d[a] == targets[s + a]:
                a += 1
            final = targets[s + a]
        else:
            assert probs is not None
            final, a = _verify_random(sampler, r, probs[s : s + k + 1], d)
        rid = r.request_id
        out.sampled[rid] = final
        out.accepted[rid] = d[:a]
        if params[i].logprobs is not None:
            emitted.append((i, [*d[:a], final]))
    if emitted:
        _add_logprobs(out, raw, reqs, starts, emitted)
    return out


def _verify_random(
    sampler: Sampler, r: Request, p: torch.Tensor, d: list[int]
) -> tuple[int, int]:
    """(final token, drafts accepted) for one request: ``p`` [k + 1, vocab] normalised."""
    k = len(d)
    g = sampler._generator(r) if r.sampling_params.seed is not None else sampler.generator
    dev = p.device
    a = k
    if k:
        idx = torch.tensor(d, dtype=torch.long, device=dev)
        p_draft = p[torch.arange(k, device=dev), idx]
        u = torch.rand(k, generator=g, device=dev, dtype=p.dtype)
        rejected = (u >= p_draft).tolist()
        a = rejected.index(True) if True in rejected else k
    if a < k:
        q = p[a].clone()
        q[d[a]] = 0.0  # the residual max(p - onehot(d), 0), up to normalisation
    else:
        q = p[k]
    noise = torch.empty_like(q).exponential_(generator=g)
    return int(argmax((q / noise)[None, :])[0]), a


def _add_logprobs(
    out: VerifyOutput, raw: torch.Tensor, reqs: Sequence[Request], starts: list[int],
    emitted: list[tuple[int, list[int]]],
) -> None:
    """Raw-model logprobs of every emitted token (the drafts kept and the final one)."""
    rows: list[int] = []
    tokens: list[int] = []
    params = []
    for i, toks in emitted:
        rows.extend(range(starts[i], starts[i] + len(toks)))
        tokens.extend(toks)
        params.extend([reqs[i].sampling_params] * len(toks))
    lp = torch.log_softmax(raw[rows].float(), dim=-1)
    got = _logprobs(lp, list(range(len(rows))), tokens, params, len(rows))
    j = 0
    for i, toks in emitted:
        mine = [x for x in got[j : j + len(toks)] if x is not None]
        j += len(toks)
        rid = reqs[i].request_id
        out.accepted_logprobs[rid] = mine[:-1]
        out.logprobs[rid] = mine[-1]
