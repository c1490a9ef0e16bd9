"""``/v1/completions``: one or many prompts (text or token ids), echo, logprobs with
text offsets, streamed or not."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from iterserve.core.outputs import TokenLogprobs
from iterserve.core.sampling_params import SamplingParams
from iterserve.entrypoints.guards import (
    bad_request,
    parse_body,
    read_json,
)
from iterserve.entrypoints.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
)
from iterserve.entrypoints.serving_base import (
    ServingBase,
    _log_unknown_fields,
    _sse,
    _usage,
    _usage_counts,
)


class CompletionServing(ServingBase):
    """``/v1/completions``."""

    async def completions(self, raw: Request) -> Response:
        body = await read_json(raw, self.config.max_request_body_bytes)
        req = parse_body(CompletionRequest, body)
        _log_unknown_fields(req)
        model = self.check_model(req.model)
        public_id, request_id = self.request_ids(raw)
        if req.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        max_tokens = req.max_tokens
        limit = self.config.max_tokens_limit
        if "max_tokens" not in req.model_fields_set and max_tokens and limit is not None:
            max_tokens = min(max_tokens, limit)  # OpenAI's default (16) may be over the limit
        params = self.sampling_params(req, max_tokens=max_tokens, logprobs=req.logprobs)
        await self.compile_structured(req)
        raw_prompts = _split_prompts(req.prompt)
        if len(raw_prompts) > self.config.max_prompts:
            raise bad_request(f"prompt may hold at most {self.config.max_prompts} prompts",
                              param="prompt")
        self.check_alive()
        reservation = self.admission.reserve_requests(len(raw_prompts) * params.n)
        handed_off = False
        try:
            prompts = [
                p if isinstance(p, list)
                else await self.engine.encode(p, add_special_tokens=req.add_special_tokens)
                for p in raw_prompts
            ]
            prompts = self.truncate_prompts(prompts, req.truncate_prompt_tokens)
            self.check_length(prompts, params.max_tokens, "prompt")
            cost = sum(len(p) + (params.max_tokens or 0) for p in prompts) * params.n
            self.admission.reserve_tokens(reservation, cost)
            echo = None
            if req.echo:
                echo = [p if isinstance(p, str) else await self.engine.decode(p)
                        for p in raw_prompts]
            tenant = self.tenant(raw, req)
            if req.stream:
                include_usage = bool(req.stream_options and req.stream_options.include_usage)
                chunks = self._completion_chunks(
                    prompts, params, request_id, public_id, req.priority, tenant, model,
                    include_usage, echo,
                )
                handed_off = True
                return self.stream(chunks, reservation, request_id, public_id)
            choices = await self.run_engine_errors(
                self.collect(raw, prompts, params, request_id, req.priority, tenant)
            )
        finally:
            if not handed_off:
                reservation.release()
        out = []
        for i, c in enumerate(choices):
            text = c.text if echo is None else echo[i // params.n] + c.text
            out.append(CompletionChoice(
                index=i, text=text, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                logprobs=self._completion_logprobs(c.logprobs, 0) if params.logprobs is not None
                else None,
            ))
        return JSONResponse(CompletionResponse(
            id=f"cmpl-{public_id}", model=model, choices=out,
            usage=_usage(prompts, choices),
        ).model_dump(), headers={"X-Request-Id": public_id})

    async def _completion_chunks(
        self, prompts: list[list[int]], params: SamplingParams, request_id: str, public_id: str,
        priority: int, tenant: str, model: str, include_usage: bool, echo: list[str] | None,
    ) -> AsyncIterator[str]:
        rid, created = f"cmpl-{public_id}", int(time.time())
        num_choices = len(prompts) * params.n
        offsets = [0] * num_choices
        num_out = [0] * num_choices

        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            return _sse({"id": rid, "object": "text_completion", "created": created,
                         "model": model, "choices": choices, "usage": usage})

        if echo is not None:
            for i in range(num_choices):
                text = echo[i // params.n]
                offsets[i] = len(text)
                yield chunk([{"index": i, "text": text, "logprobs": None,
                              "finish_reason": None, "stop_reason": None}])
        async for d in self.engine.generate(prompts, params, request_id, priority=priority,
                                            tenant=tenant):
            num_out[d.index] += len(d.token_ids)
            lp = None
            if params.logprobs is not None and d.logprobs:
                lp = self._completion_logprobs(d.logprobs, offsets[d.index]).model_dump()
            if not d.text and lp is None and d.finish_reason is None:
                continue  # nothing decided yet (a partial character or a held-back stop prefix)
            offsets[d.index] += len(d.text)
            yield chunk([{"index": d.index, "text": d.text, "logprobs": lp,
                          "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}])
        if include_usage:
            yield chunk([], _usage_counts(prompts, params.n, num_out).model_dump())

    def _completion_logprobs(self, lps: list[TokenLogprobs], offset: int) -> CompletionLogProbs:
        out = CompletionLogProbs()
        token_str = self.engine.token_str
        for tl in lps:
            s = token_str(tl.token_id)
            out.tokens.append(s)
            out.token_logprobs.append(tl.logprob)
            out.text_offset.append(offset)
            offset += len(s)
            top = {token_str(t): lp for t, lp in tl.top}
            top.setdefault(s, tl.logprob)
            out.top_logprobs.append(top)
        return out


def _split_prompts(prompt: Any) -> list[str | list[int]]:
    """OpenAI's four prompt shapes -> a list of prompts (text or token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)
