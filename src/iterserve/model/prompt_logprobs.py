"""Prompt logprobs (vLLM's ``prompt_logprobs``, what ``echo`` with ``logprobs`` shows):
the log-probability of each prompt token given the ones before it, from the logits the
prefill computes at every prompt position anyway (the sampler only needs the last).

Recorded on ``Request.prompt_logprobs`` (entry k: prompt token k + 1), chunk by chunk as
prefill runs, on the engine thread; the prompt's last chunk also samples the first
output token, so the list is complete when that token reaches the loop.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from iterserve.core.outputs import SchedulerOutput, TokenLogprobs
from iterserve.core.request import Request

# Logit rows per slice: a prompt's chunk can be long and the vocabulary large.
_ROWS_PER_SLICE = 256


def wanted(so: SchedulerOutput) -> list[int]:
    """Indices of scheduled requests whose chunk covers positions that predict a prompt
    token they still have to record."""
    out = []
    for i, r in enumerate(so.scheduled_requests):
        plp = r.prompt_logprobs
        if plp is not None and len(plp) < r.num_prompt_tokens - 1:
            c = so.num_computed_tokens[i]
            if c + 1 < r.num_prompt_tokens and len(plp) < c + so.num_scheduled_tokens[i]:
                out.append(i)
    return out


def _rows(num_new: Sequence[int], num_computed: Sequence[int]) -> dict[int, int]:
    """Each request's first row in the step's flattened batch, in the model runner's
    layout: one-token steps first (shortest context first), then the longer chunks."""
    decodes = sorted((i for i, n in enumerate(num_new) if n == 1), key=num_computed.__getitem__)
    rows = {i: k for k, i in enumerate(decodes)}
    offset = len(decodes)
    for i, n in enumerate(num_new):
        if n != 1:
            rows[i] = offset
            offset += n
    return rows


@torch.inference_mode()
def record(model: torch.nn.Module, so: SchedulerOutput, hidden: torch.Tensor,
           indices: list[int]) -> None:
    rows = _rows(so.num_scheduled_tokens, so.num_computed_tokens)
    for i in indices:
        r: Request = so.scheduled_requests[i]
        plp = r.prompt_logprobs
        assert plp is not None
        c, n = so.num_computed_tokens[i], so.num_scheduled_tokens[i]
        # Position p predicts token p + 1; positions already recorded (a preempted
        # request recomputing) are skipped.
        start, end = max(c, len(plp)), min(c + n, r.num_prompt_tokens - 1)
        k = r.sampling_params.prompt_logprobs or 0
        for a in range(start, end, _ROWS_PER_SLICE):
            b = min(a + _ROWS_PER_SLICE, end)
            h = hidden[rows[i] + a - c: rows[i] + b - c]
            lp = torch.log_softmax(model.compute_logits(h).float(), dim=-1)  # type: ignore[operator]
            targets = torch.tensor(r.all_token_ids[a + 1: b + 1], device=lp.device)
            chosen = lp.gather(1, targets[:, None])
            ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
            top_i: list[list[int]] = [[] for _ in range(b - a)]
            top_v: list[list[float]] = [[] for _ in range(b - a)]
            if k:
                v, idx = lp.topk(min(k, lp.shape[-1]), dim=-1)
                top_v, top_i = v.tolist(), idx.tolist()
            for j, (t, x) in enumerate(zip(targets.tolist(), chosen[:, 0].tolist(), strict=True)):
                plp.append(TokenLogprobs(token_id=t, logprob=x, rank=ranks[j],
                                         top=list(zip(top_i[j], top_v[j], strict=True))))
