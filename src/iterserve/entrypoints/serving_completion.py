"""``/v1/completions``: one or many prompts (text or token ids), echo, logprobs with
text offsets, streamed or not."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from iterserve.core.outputs import TokenLogprobs
from iterserve.core.sampling_params import SamplingParams
from iterserve.entrypoints.guards import bad_request
from iterserve.entrypoints.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
)
from iterserve.entrypoints.request_body import read_request
from iterserve.entrypoints.request_fields import StreamOpts, prompt_logprobs_out
from iterserve.entrypoints.serving_base import (
    ServingBase,
    _cached_tokens,
    _log_unknown_fields,
    _sse,
    _usage,
    _usage_counts,
)


class CompletionServing(ServingBase):
    """``/v1/completions``."""

    async def completions(self, raw: Request) -> Response:
        req = await read_request(raw, CompletionRequest, self.config.max_request_body_bytes,
                                 self.precheck)
        _log_unknown_fields(req)
        model = self.check_model(req.model)
        public_id, request_id = self.request_ids(raw, req.request_id)
        if req.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        max_tokens = req.max_tokens
        limit = self.config.max_tokens_limit
        if "max_tokens" not in req.model_fields_set and max_tokens and limit is not None:
            max_tokens = min(max_tokens, limit)  # OpenAI's default (16) may be over the limit
        params = await self.sampling_params(req, max_tokens=max_tokens, logprobs=req.logprobs)
        if req.echo and params.logprobs is not None:  # the echoed prompt's logprobs too
            params = dataclasses.replace(
                params, prompt_logprobs=max(params.logprobs, params.prompt_logprobs or 0))
        name = self.token_namer(req)
        raw_prompts = _split_prompts(req.prompt)
        if len(raw_prompts) > self.config.max_prompts:
            raise bad_request(f"prompt may hold at most {self.config.max_prompts} prompts",
                              param="prompt")
        self.check_alive()
        keep = self.truncation(req.truncate_prompt_tokens, params)  # before reserving
        reservation = self.admission.reserve_requests(len(raw_prompts) * params.n)
        handed_off = False
        try:
            prompts = [
                p if isinstance(p, list)
                else await self.tokenize_text(p, add_special_tokens=req.add_special_tokens,
                                              field="prompt", keep_last=keep)
                for p in raw_prompts
            ]
            prompts = self.truncate_prompts(prompts, keep)
            self.check_length(prompts, params.max_tokens, "prompt", params.min_tokens)
            self.log_request(public_id, prompts,
                             req.prompt if isinstance(req.prompt, str) else None, params)
            cost = sum(len(p) + (params.max_tokens or 0) for p in prompts) * params.n
            self.admission.reserve_tokens(reservation, cost)
            echo = None
            if req.echo:
                echo = [p if isinstance(p, str) else await self.engine.decode(p)
                        for p in raw_prompts]
            tenant = self.tenant(raw, req)
            route = self.routing(raw, req)
            if req.stream:
                chunks = self._completion_chunks(
                    prompts, params, request_id, public_id, req.priority, tenant, model,
                    StreamOpts.of(req, name, force_usage=self.config.enable_force_include_usage),
                    echo, route=route,
                )
                handed_off = True
                return self.stream(chunks, reservation, request_id, public_id)
            choices = await self.run_engine_errors(
                self.collect(raw, prompts, params, request_id, req.priority, tenant,
                             route)
            )
        finally:
            if not handed_off:
                reservation.release()
        out = []
        for i, c in enumerate(choices):
            prefix = "" if echo is None else echo[i // params.n]
            out.append(CompletionChoice(
                index=i, text=prefix + c.text, finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                # Offsets index the returned text: generated tokens start after the echo.
                logprobs=self._choice_logprobs(
                    prompts[i // params.n] if echo is not None else None,
                    c.prompt_logprobs, c.logprobs, len(prefix), name, params.logprobs)
                if params.logprobs is not None else None,
                token_ids=c.token_ids if req.return_token_ids else None,
                prompt_token_ids=prompts[i // params.n] if req.return_token_ids else None,
                prompt_logprobs=prompt_logprobs_out(prompts[i // params.n], c.prompt_logprobs,
                                                    req.prompt_logprobs, name)
                if req.prompt_logprobs is not None else None,
            ))
        return JSONResponse(CompletionResponse(
            id=f"cmpl-{public_id}", model=model, choices=out,
            usage=self.with_cached_tokens(_usage(prompts, choices), _cached_tokens(
                [c.num_cached_tokens for c in choices], len(prompts))),
        ).model_dump(), headers={"X-Request-Id": public_id})

    async def _completion_chunks(
        self, prompts: list[list[int]], params: SamplingParams, request_id: str, public_id: str,
        priority: int, tenant: str, model: str, opts: StreamOpts, echo: list[str] | None,
        route: dict[str, Any] | None = None,
    ) -> AsyncIterator[str]:
        """A chunk per engine output, as vLLM sends them: a token whose text is not yet
        decidable (part of a character, a held-back stop prefix) still makes one, with
        empty text, so clients timing chunks see every token when it comes."""
        rid, created = f"cmpl-{public_id}", int(time.time())
        n = params.n
        num_choices = len(prompts) * n
        offsets = [0] * num_choices
        num_out = [0] * num_choices
        cached = [0] * num_choices
        started = [False] * num_choices  # the choice's first chunk is out

        def chunk(index: int, text: str, lp: dict | None, finish: str | None = None,
                  stop_reason: int | str | None = None,
                  token_ids: list[int] | None = None) -> str:
            choice: dict[str, Any] = {"index": index, "text": text, "logprobs": lp,
                                      "finish_reason": finish, "stop_reason": stop_reason}
            if opts.return_token_ids:
                if not started[index]:
                    choice["prompt_token_ids"] = prompts[index // n]
                choice["token_ids"] = token_ids or []
            started[index] = True
            usage = None
            if opts.continuous_usage:
                p, c = len(prompts[index // n]), num_out[index]
                usage = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
            return _sse({"id": rid, "object": "text_completion", "created": created,
                         "model": model, "choices": [choice], "usage": usage})

        # With logprobs, the echo waits for the first delta: it brings the prompt's.
        echo_later = echo is not None and params.logprobs is not None
        if echo is not None and not echo_later:
            for i in range(num_choices):
                text = echo[i // n]
                offsets[i] = len(text)
                yield chunk(i, text, None)
        echoed = [False] * num_choices
        lp: dict[str, Any] | None
        async for d in self.engine.generate(prompts, params, request_id, priority=priority,
                                            tenant=tenant, **(route or {})):
            if echo is not None and echo_later and not echoed[d.index]:
                echoed[d.index] = True
                text = echo[d.index // n]
                offsets[d.index] = len(text)
                lp = self._choice_logprobs(prompts[d.index // n], d.prompt_logprobs,
                                           [], 0, opts.name, params.logprobs or 0).model_dump()
                yield chunk(d.index, text, lp)
            num_out[d.index] += len(d.token_ids)
            cached[d.index] = d.num_cached_tokens
            lp = None
            if params.logprobs is not None and d.logprobs:
                lp = self._completion_logprobs(d.logprobs, offsets[d.index],
                                               opts.name).model_dump()
            if not d.token_ids and not d.text and lp is None and d.finish_reason is None:
                continue  # no engine output to report
            offsets[d.index] += len(d.text)
            yield chunk(d.index, d.text, lp, d.finish_reason, d.stop_reason, d.token_ids)
        if opts.include_usage:
            usage = self.with_cached_tokens(_usage_counts(prompts, n, num_out),
                                            _cached_tokens(cached, len(prompts)))
            yield _sse({"id": rid, "object": "text_completion", "created": created,
                        "model": model, "choices": [], "usage": usage.model_dump()})

    def _choice_logprobs(self, prompt: list[int] | None, prompt_lps: list[TokenLogprobs] | None,
                         lps: list[TokenLogprobs], offset: int, token_str: Callable[[int], str],
                         top_n: int) -> CompletionLogProbs:
        """OpenAI's shape: with echo, the prompt's tokens first (the first has no
        logprob: nothing precedes it), offsets from 0; then the generated tokens', their
        offsets from ``offset`` (the end of the echoed text)."""
        out = self._completion_logprobs(lps, offset, token_str)
        if prompt is None:
            return out
        head = CompletionLogProbs()
        pos = 0
        given = prompt_lps or []
        for k, t in enumerate(prompt):
            s = token_str(t)
            head.tokens.append(s)
            head.text_offset.append(pos)
            pos += len(s)
            tl = given[k - 1] if 0 < k <= len(given) else None
            if tl is None:
                head.token_logprobs.append(None)
                head.top_logprobs.append(None)
                continue
            head.token_logprobs.append(tl.logprob)
            top = {token_str(i): lp for i, lp in tl.top[:top_n]}
            top.setdefault(s, tl.logprob)
            head.top_logprobs.append(top)
        head.tokens += out.tokens
        head.text_offset += out.text_offset
        head.token_logprobs += out.token_logprobs
        head.top_logprobs += out.top_logprobs
        return head

    def _completion_logprobs(self, lps: list[TokenLogprobs], offset: int,
                             token_str: Callable[[int], str]) -> CompletionLogProbs:
        out = CompletionLogProbs()
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
