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
the raw model's, as for plain sampling. ``min_tokens`` and the penalties are applied
per position, over the history that position has. Requests with bad words or grammars
never get drafts (``core.spec_decode.eligible``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from iterserve.core.outputs import TokenLogprobs
from iterserve.core.request import Request
from iterserve.model.logits_processors import apply_logit_controls
from iterserve.model.sampler import Sampler, _logprobs, argmax, penalize, target_probs


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
    if any(p.min_tokens for p in params):
        logits = _suppress_stop_tokens(logits, reqs, starts, drafts)
    if any(p.has_penalties for p in params):
        logits = _penalize(logits, reqs, drafts)
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
            a = greedy_accepted(d, targets[s : s + k + 1])
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


def greedy_accepted(draft: Sequence[int], targets: Sequence[int]) -> int:
    """How many of a greedy request's draft tokens its target picks accept: the longest
    prefix where draft j equals the pick at position j (``targets``: the picks at the
    request's 1 + k verify positions)."""
    a = 0
    while a < len(draft) and draft[a] == targets[a]:
        a += 1
    return a


def _suppress_stop_tokens(
    logits: torch.Tensor, reqs: Sequence[Request], starts: list[int],
    drafts: Sequence[list[int]],
) -> torch.Tensor:
    """min_tokens, per position: row ``j`` follows ``num_output_tokens + j`` outputs, so
    its EOS / stop tokens are banned while that is below min_tokens (as the sampler
    does for the one position of a plain decode)."""
    rows: list[int] = []
    cols: list[int] = []
    vocab = logits.shape[1]
    for r, s, d in zip(reqs, starts, drafts):
        p = r.sampling_params
        if not p.min_tokens:
            continue
        stops = list(p.stop_token_ids)
        if r.eos_token_id is not None and not p.ignore_eos:
            stops.append(r.eos_token_id)
        stops = [t for t in stops if 0 <= t < vocab]
        n_out = r.num_output_tokens
        for j in range(len(d) + 1):
            if n_out + j < p.min_tokens:
                rows.extend([s + j] * len(stops))
                cols.extend(stops)
    if not rows:
        return logits
    logits = logits.clone()
    logits[rows, cols] = float("-inf")
    return logits


def _penalize(
    logits: torch.Tensor, reqs: Sequence[Request], drafts: Sequence[list[int]]
) -> torch.Tensor:
    """Penalties per position: row ``j`` counts the request's tokens and its first ``j``
    drafts, the history plain decoding would have there if they are accepted."""
    params = []
    out_ids: list[list[int]] = []
    all_ids: list[list[int]] = []
    for r, d in zip(reqs, drafts):
        out, seq = r.output_token_ids, r.all_token_ids
        for j in range(len(d) + 1):
            params.append(r.sampling_params)
            out_ids.append(out + d[:j])
            all_ids.append(seq + d[:j])
    return penalize(logits, params, out_ids, all_ids)


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
