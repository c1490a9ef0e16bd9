"""``/v1/chat/completions``: messages through the tokenizer's chat template, streamed
(role first, then content deltas) or not."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

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
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogProbs,
    ChatResponseMessage,
    ChatTokenLogprob,
    TopLogprob,
)
from iterserve.entrypoints.serving_base import (
    ServingBase,
    _log_unknown_fields,
    _message_dict,
    _sse,
    _usage,
    _usage_counts,
)


class ChatServing(ServingBase):
    """``/v1/chat/completions``."""

    async def chat(self, raw: Request) -> Response:
        req = parse_body(
            ChatCompletionRequest, await read_json(raw, self.config.max_request_body_bytes)
        )
        _log_unknown_fields(req)
        model = self.check_model(req.model)
        public_id, request_id = self.request_ids(raw)
        if req.tools and req.tool_choice != "none":
            raise bad_request("tools are not supported", param="tools")
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        max_tokens = req.max_completion_tokens or req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        # max_tokens None (OpenAI's default for chat): up to the context length, resolved
        # after tokenization; validate the rest with a placeholder now.
        params = self.sampling_params(req, max_tokens=max_tokens, logprobs=logprobs,
                                      logprobs_param="top_logprobs")
        await self.compile_structured(req)
        messages = [_message_dict(m, i) for i, m in enumerate(req.messages)]
        self.check_alive()
        reservation = self.admission.reserve_requests(params.n)
        handed_off = False
        try:
            try:
                text = await self.engine.render_chat(
                    messages,
                    add_generation_prompt=req.add_generation_prompt,
                    continue_final_message=req.continue_final_message,
                    chat_template=req.chat_template,
                    chat_template_kwargs=req.chat_template_kwargs,
                )
            except Exception as e:  # a template error is the caller's input
                raise bad_request(f"could not apply the chat template: {e}",
                                  param="messages") from None
            prompt = await self.engine.encode(text, add_special_tokens=req.add_special_tokens)
            self.check_length([prompt], max_tokens, "messages")
            if max_tokens is None:
                import dataclasses

                max_new = self.max_model_len - len(prompt)
                if self.config.max_tokens_limit is not None:
                    max_new = min(max_new, self.config.max_tokens_limit)
                params = dataclasses.replace(params, max_tokens=max_new)
            self.admission.reserve_tokens(reservation, (len(prompt) + params.max_tokens) * params.n)
            tenant = self.tenant(raw, req)
            if req.stream:
                include_usage = bool(req.stream_options and req.stream_options.include_usage)
                chunks = self._chat_chunks(
                    [prompt], params, request_id, public_id, req.priority, tenant, model,
                    include_usage, bool(req.logprobs),
                )
                handed_off = True
                return self.stream(chunks, reservation, request_id, public_id)
            choices = await self.run_engine_errors(
                self.collect(raw, [prompt], params, request_id, req.priority, tenant)
            )
        finally:
            if not handed_off:
                reservation.release()
        out = [
            ChatCompletionChoice(
                index=i,
                message=ChatResponseMessage(content=c.text),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                logprobs=ChatLogProbs(content=self._chat_logprobs(c.logprobs, logprobs or 0))
                if req.logprobs else None,
            )
            for i, c in enumerate(choices)
        ]
        return JSONResponse(ChatCompletionResponse(
            id=f"chatcmpl-{public_id}", model=model, choices=out,
            usage=_usage([prompt], choices),
        ).model_dump(), headers={"X-Request-Id": public_id})

    async def _chat_chunks(
        self, prompts: list[list[int]], params: SamplingParams, request_id: str, public_id: str,
        priority: int, tenant: str, model: str, include_usage: bool, want_logprobs: bool,
    ) -> AsyncIterator[str]:
        rid, created = f"chatcmpl-{public_id}", int(time.time())
        num_out = [0] * params.n

        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            return _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                         "model": model, "choices": choices, "usage": usage})

        for i in range(params.n):  # the role comes first, as OpenAI sends it
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}])
        top_n = params.logprobs or 0
        async for d in self.engine.generate(prompts, params, request_id, priority=priority,
                                            tenant=tenant):
            num_out[d.index] += len(d.token_ids)
            lp = None
            if want_logprobs and d.logprobs:
                lp = {"content": [t.model_dump() for t in self._chat_logprobs(d.logprobs, top_n)]}
            if not d.text and lp is None and d.finish_reason is None:
                continue
            delta = {"content": d.text} if d.text else {}
            yield chunk([{"index": d.index, "delta": delta, "logprobs": lp,
                          "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}])
        if include_usage:
            yield chunk([], _usage_counts(prompts, params.n, num_out).model_dump())

    def _chat_logprobs(self, lps: list[TokenLogprobs], top_n: int) -> list[ChatTokenLogprob]:
        token_str = self.engine.token_str
        out = []
        for tl in lps:
            s = token_str(tl.token_id)
            top = [TopLogprob(token=token_str(t), logprob=lp, bytes=list(token_str(t).encode()))
                   for t, lp in tl.top[:top_n]]
            out.append(ChatTokenLogprob(token=s, logprob=tl.logprob, bytes=list(s.encode()),
                                        top_logprobs=top))
        return out

