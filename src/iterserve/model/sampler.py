"""Batched sampling: one [num_reqs, vocab] logits tensor in, one token per row out.

Every transformation runs on the whole batch at once (per-row parameters become
[num_reqs] tensors); Python loops run over requests only to collect their
parameters, never over the vocabulary. Order, as vLLM: raw logprobs (what
``logprobs`` reports) -> grammar masks (structured outputs) -> logit_bias,
allowed_token_ids, bad_words -> min_tokens suppression -> penalties -> temperature ->
top-k / top-p -> min-p -> sample (greedy rows take the argmax).

Random rows sample with the exponential race (argmax of p / E, E ~ Exp(1)),
which needs one vector of noise per row: a seeded request draws its noise from
its own ``torch.Generator``, so its tokens do not depend on who shares the batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from iterserve.core.outputs import GrammarBitmask, TokenLogprobs
from iterserve.core.request import Request
from iterserve.model import cpu_ops
from iterserve.model.logits_processors import (
    BadWords,
    apply_grammar_bitmask,
    apply_logit_controls,
)


def argmax(x: torch.Tensor, use_cpp: bool = True) -> torch.Tensor:
    """Row-wise argmax; our C++ kernel on CPU float32 when ``use_cpp`` and it is loaded
    (torch's CPU argmax is a scalar loop, a visible share of a batch-1 decode step
    over a large vocabulary). Same result, ties and NaN included."""
    if (use_cpp and x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2
            and cpu_ops.loaded()):
        return torch.ops.iterserve_cpu.argmax(x)
    return x.argmax(dim=-1)


class Sampler:
    """``cpp_argmax``: greedy rows may take our C++ argmax (the cpp backend)."""

    def __init__(self, device: torch.device | str = "cpu", seed: int = 0, *,
                 cpp_argmax: bool = True) -> None:
        self.device = torch.device(device)
        self.cpp_argmax = cpp_argmax
        # Unseeded requests share one generator, seeded from the engine seed so a
        # whole run is reproducible.
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.request_generators: dict[str, torch.Generator] = {}
        # Each bad_words request's index, built on its first step (logits_processors).
        self.bad_words: dict[str, BadWords] = {}

    def drop(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self.request_generators.pop(rid, None)
            self.bad_words.pop(rid, None)

    def _generator(self, req: Request) -> torch.Generator:
        g = self.request_generators.get(req.request_id)
        if g is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(int(req.sampling_params.seed))  # type: ignore[arg-type]
            self.request_generators[req.request_id] = g
        return g

    @staticmethod
    def is_plain_greedy(req: Request) -> bool:
        """Whether the request's next token is the plain argmax of its logits: greedy,
        no logprobs, no penalties, no stop tokens held back by min_tokens (then the
        logits need not even leave the model, see ``cpu_ops`` ``Decoder.step_greedy``)."""
        p = req.sampling_params
        return (
            p.is_greedy
            and p.logprobs is None
            and not p.has_penalties
            and not (p.min_tokens and req.num_output_tokens < p.min_tokens)
            and p.structured_outputs is None
            and not p.has_logit_controls
        )

    def sample(
        self,
        logits: torch.Tensor,
        reqs: Sequence[Request],
        grammar: GrammarBitmask | None = None,
    ) -> tuple[list[int], list[TokenLogprobs | None] | None]:
        """logits [num_reqs, vocab] (float32) -> (token ids, per-row logprobs or None)."""
        params = [r.sampling_params for r in reqs]
        num_reqs, vocab = logits.shape
        dev = logits.device

        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits[lp_rows], dim=-1) if lp_rows else None
        if grammar is not None:
            logits = apply_grammar_bitmask(logits, reqs, grammar)
        if any(p.has_logit_controls for p in params):
            logits = apply_logit_controls(logits, reqs, self.bad_words)

        logits = self._suppress_stop_tokens(logits, reqs, vocab)
        if any(p.has_penalties for p in params):
            logits = apply_penalties(logits, reqs)

        is_greedy = [p.is_greedy for p in params]
        if all(is_greedy):
            tokens = argmax(logits, self.cpp_argmax)
        else:
            probs = target_probs(logits, params, is_greedy)
            noise = torch.empty_like(probs)
            noise.exponential_(generator=self.generator)
            for i, r in enumerate(reqs):
                if not is_greedy[i] and params[i].seed is not None:
                    noise[i].exponential_(generator=self._generator(r))
            sampled = argmax(probs / noise)
            if any(is_greedy):
                greedy = torch.tensor(is_greedy, device=dev)
                sampled = torch.where(greedy, argmax(logits, self.cpp_argmax), sampled)
            tokens = sampled

        token_list = tokens.tolist()
        if raw_logprobs is None:
            return token_list, None
        return token_list, _logprobs(raw_logprobs, lp_rows, token_list, params, num_reqs)

    @staticmethod
    def _suppress_stop_tokens(
        logits: torch.Tensor, reqs: Sequence[Request], vocab: int
    ) -> torch.Tensor:
        """Before min_tokens outputs, EOS and stop_token_ids cannot be sampled."""
        rows: list[int] = []
        cols: list[int] = []
        for i, r in enumerate(reqs):
            p = r.sampling_params
            if p.min_tokens and r.num_output_tokens < p.min_tokens:
                stops = list(p.stop_token_ids)
                if r.eos_token_id is not None and not p.ignore_eos:
                    stops.append(r.eos_token_id)
                for t in stops:
                    if 0 <= t < vocab:
                        rows.append(i)
                        cols.append(t)
        if not rows:
            return logits
        logits = logits.clone()
        logits[rows, cols] = float("-inf")
        return logits


def target_probs(
    logits: torch.Tensor, params: Sequence, is_greedy: Sequence[bool]
) -> torch.Tensor:
    """The distribution random rows sample from: temperature, top-k / top-p, min-p
    (greedy rows keep temperature 1; their row is unused). Shared with speculative
    decoding's rejection sampler, so verified tokens follow exactly this distribution."""
    vocab = logits.shape[1]
    dev = logits.device
    temps = torch.tensor(
        [1.0 if g else p.temperature for g, p in zip(is_greedy, params)],
        dtype=logits.dtype,
        device=dev,
    )
    x = logits / temps[:, None]
    top_k = [p.top_k if p.top_k > 0 else vocab for p in params]
    top_p = [p.top_p for p in params]
    if any(k < vocab for k in top_k) or any(tp < 1.0 for tp in top_p):
        x = apply_top_k_top_p(x, top_k, top_p)
    probs = torch.softmax(x, dim=-1)
    min_p = [p.min_p for p in params]
    if any(mp > 0.0 for mp in min_p):
        mp = torch.tensor(min_p, dtype=probs.dtype, device=dev)[:, None]
        probs = probs.masked_fill(probs < mp * probs.amax(dim=-1, keepdim=True), 0.0)
    return probs


def apply_penalties(logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
    """Repetition (prompt + output tokens, divide positive / multiply negative logits),
    frequency (minus count * f) and presence (minus p if seen) over output tokens."""
    return penalize(logits, [r.sampling_params for r in reqs],
                    [r.output_token_ids for r in reqs], [r.all_token_ids for r in reqs])


def penalize(logits: torch.Tensor, params: Sequence, out_ids: list[list[int]],
             all_ids: list[list[int]]) -> torch.Tensor:
    """``apply_penalties`` over explicit histories per row (speculative decoding's rows
    each follow the request's tokens plus the drafts before them)."""
    num_reqs, vocab = logits.shape
    dev = logits.device
    out_counts = _counts(out_ids, num_reqs, vocab, dev)
    seen = _counts(all_ids, num_reqs, vocab, dev) > 0
    rep = torch.tensor([p.repetition_penalty for p in params], device=dev)[:, None]
    freq = torch.tensor([p.frequency_penalty for p in params], device=dev)[:, None]
    pres = torch.tensor([p.presence_penalty for p in params], device=dev)[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    return logits - freq * out_counts - pres * (out_counts > 0).to(logits.dtype)


def _counts(
    seqs: list[list[int]], num_reqs: int, vocab: int, device: torch.device
) -> torch.Tensor:
    """[num_reqs, vocab] float token counts, built with one scatter_add."""
    lens = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=num_reqs)
    counts = torch.zeros(num_reqs, vocab, device=device)
    if lens.sum() == 0:
        return counts
    flat = np.fromiter((t for s in seqs for t in s), dtype=np.int64, count=int(lens.sum()))
    rows = np.repeat(np.arange(num_reqs, dtype=np.int64), lens)
    idx = torch.from_numpy(rows * vocab + flat).to(device)
    counts.view(-1).index_add_(0, idx, torch.ones(idx.numel(), device=device))
    return counts


def apply_top_k_top_p(x: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask everything outside each row's top-k and top-p nucleus with -inf (one sort)."""
    dev = x.device
    sorted_x, order = x.sort(dim=-1, descending=True)
    k = torch.tensor(top_k, device=dev, dtype=torch.long)
    # Keep the k largest: compare with the k-th largest value (ties stay in).
    kth = sorted_x.gather(1, (k - 1).clamp(min=0)[:, None])
    sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    p = torch.tensor(top_p, device=dev, dtype=x.dtype)[:, None]
    probs = sorted_x.softmax(dim=-1)
    # Drop a token when the mass strictly before it already reaches top_p
    # (the first token always stays).
    before = probs.cumsum(dim=-1) - probs
    sorted_x = sorted_x.masked_fill(before >= p, float("-inf"))
    return torch.full_like(x, float("-inf")).scatter(1, order, sorted_x)


def _logprobs(
    raw: torch.Tensor,
    rows: list[int],
    tokens: list[int],
    params: Sequence,
    num_reqs: int,
) -> list[TokenLogprobs | None]:
    dev = raw.device
    chosen = torch.tensor([tokens[i] for i in rows], device=dev)
    chosen_lp = raw.gather(1, chosen[:, None])
    ranks = ((raw > chosen_lp).sum(dim=-1) + 1).tolist()
    max_n = max(params[i].logprobs for i in rows)
    if max_n > 0:
        top_v, top_i = raw.topk(min(max_n, raw.shape[-1]), dim=-1)
        top_vals, top_ids = top_v.tolist(), top_i.tolist()
    chosen_list = chosen_lp[:, 0].tolist()
    out: list[TokenLogprobs | None] = [None] * num_reqs
    for j, i in enumerate(rows):
        n = params[i].logprobs
        top = list(zip(top_ids[j][:n], top_vals[j][:n])) if n else []
        out[i] = TokenLogprobs(
            token_id=tokens[i], logprob=chosen_list[j], rank=ranks[j], top=top
        )
    return out
