"""``/v1/chat/completions``: messages through the tokenizer's chat template, streamed
(role first, then content deltas) or not; tool calls per ``entrypoints/tools.py``,
reasoning per ``entrypoints/reasoning.py``, both split off per ``chat_stream.py``."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from iterserve.core.outputs import TokenLogprobs
from iterserve.core.sampling_params import SamplingParams
from iterserve.entrypoints.chat_stream import ChatDeltas, ChatReasoning, message_reasoning, reply
from iterserve.entrypoints.guards import bad_request, param_of
from iterserve.entrypoints.protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogProbs,
    ChatResponseMessage,
    ChatTokenLogprob,
    TopLogprob,
)
from iterserve.entrypoints.reasoning import REASONING_PARSERS
from iterserve.entrypoints.request_body import read_request
from iterserve.entrypoints.request_fields import StreamOpts, prompt_logprobs_out
from iterserve.entrypoints.serving_base import (
    ServingBase,
    _cached_tokens,
    _log_unknown_fields,
    _message_dict,
    _sse,
    _usage,
    _usage_counts,
)
from iterserve.entrypoints.tools import ToolError, ToolPlan, plan_tools, template_messages


class ChatServing(ServingBase):
    """``/v1/chat/completions``."""

    async def chat(self, raw: Request) -> Response:
        req = await read_request(raw, ChatCompletionRequest,
                                 self.config.max_request_body_bytes, self.precheck)
        _log_unknown_fields(req)
        model = self.check_model(req.model)
        public_id, request_id = self.request_ids(raw, req.request_id)
        self._check_chat_template(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        max_tokens = req.max_completion_tokens or req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        # max_tokens None (OpenAI's default for chat): up to the context length, resolved
        # after tokenization; validate the rest with a placeholder now.
        params = await self.sampling_params(req, max_tokens=max_tokens, logprobs=logprobs,
                                            logprobs_param="top_logprobs")
        plan = self._tool_plan(req, params)
        if plan is not None and plan.constraint is not None:
            params = dataclasses.replace(params, structured_outputs=plan.constraint)
            await self.compile_constraint(plan.constraint, "tools")
        try:
            messages = template_messages(
                [_message_dict(m, i) for i, m in enumerate(req.messages)])
        except ToolError as e:
            raise bad_request(str(e), param=e.param) from None
        # vLLM's rule: the reply's role is --response-role, unless the last message is
        # being continued (no generation prompt): then that message's role.
        role = self.config.response_role if req.add_generation_prompt else req.messages[-1].role
        name = self.token_namer(req)
        self.check_alive()
        keep = self.truncation(req.truncate_prompt_tokens, params)  # before reserving
        reservation = self.admission.reserve_requests(params.n)
        handed_off = False
        try:
            prompt = await self.tokenize_chat(
                messages,
                keep_last=keep,  # truncate_prompt_tokens: only the rendered tail is read
                add_special_tokens=req.add_special_tokens,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                chat_template=req.chat_template,
                chat_template_kwargs=req.chat_template_kwargs,
                tools=plan.tools if plan is not None else None,
            )
            prompt = self.truncate_prompts([prompt], keep)[0]
            self.check_length([prompt], params.max_tokens, "messages", params.min_tokens)
            reasoning = await self._reasoning(prompt, req.include_reasoning)
            params = self._after_reasoning(params, reasoning)
            self.log_request(public_id, [prompt], None, params)
            if params.max_tokens is None:
                max_new = self.max_model_len - len(prompt)
                if self.config.max_tokens_limit is not None:
                    max_new = min(max_new, self.config.max_tokens_limit)
                try:
                    params = dataclasses.replace(params, max_tokens=max_new)
                except ValueError as e:  # min_tokens over what the context leaves
                    raise bad_request(str(e), param=param_of(e)) from None
            assert params.max_tokens is not None  # resolved just above
            self.admission.reserve_tokens(reservation, (len(prompt) + params.max_tokens) * params.n)
            tenant = self.tenant(raw, req)
            route = self.routing(raw, req)
            if req.stream:
                chunks = self._chat_chunks(
                    [prompt], params, request_id, public_id, req.priority, tenant, model,
                    StreamOpts.of(req, name, force_usage=self.config.enable_force_include_usage),
                    bool(req.logprobs), role, plan, route=route, reasoning=reasoning,
                )
                handed_off = True
                return self.stream(chunks, reservation, request_id, public_id)
            choices = await self.run_engine_errors(
                self.collect(raw, [prompt], params, request_id, req.priority, tenant,
                             route)
            )
        finally:
            if not handed_off:
                reservation.release()
        out = []
        for i, c in enumerate(choices):
            thought, content, calls = reply(c.text, plan, reasoning)
            out.append(ChatCompletionChoice(
                index=i,
                message=ChatResponseMessage(role=role, content=content,
                                            tool_calls=[t.to_dict() for t in calls],
                                            **message_reasoning(thought)),
                finish_reason=plan.finish_reason(c.finish_reason, calls)
                if plan is not None else c.finish_reason,
                stop_reason=c.stop_reason,
                logprobs=ChatLogProbs(content=self._chat_logprobs(c.logprobs, logprobs or 0, name))
                if req.logprobs else None,
                token_ids=c.token_ids if req.return_token_ids else None,
            ))
        return JSONResponse(ChatCompletionResponse(
            id=f"chatcmpl-{public_id}", model=model, choices=out,
            usage=self.with_cached_tokens(_usage([prompt], choices), _cached_tokens(
                [c.num_cached_tokens for c in choices], 1)),
            prompt_token_ids=prompt if req.return_token_ids else None,
            prompt_logprobs=prompt_logprobs_out(prompt, choices[0].prompt_logprobs,
                                                req.prompt_logprobs, name)
            if req.prompt_logprobs is not None and choices else None,
        ).model_dump(), headers={"X-Request-Id": public_id})

    def _check_chat_template(self, req: ChatCompletionRequest) -> None:
        """A request's own chat template is code the server would run: refused unless
        --trust-request-chat-template (as vLLM)."""
        if self.config.trust_request_chat_template:
            return
        if req.chat_template is not None:
            raise bad_request("chat_template in a request needs the server's "
                              "--trust-request-chat-template", param="chat_template")
        if req.chat_template_kwargs and "chat_template" in req.chat_template_kwargs:
            raise bad_request("chat_template in chat_template_kwargs needs the server's "
                              "--trust-request-chat-template", param="chat_template_kwargs")

    def _tool_plan(self, req: ChatCompletionRequest, params: SamplingParams) -> ToolPlan | None:
        cfg = self.config
        so = req.structured_outputs or {}
        try:
            plan = plan_tools(
                req.tools, req.tool_choice, req.parallel_tool_calls,
                enable_auto_tool_choice=cfg.enable_auto_tool_choice,
                tool_call_parser=cfg.tool_call_parser,
                disable_any_whitespace=bool(so.get("disable_any_whitespace")),
            )
        except ToolError as e:
            raise bad_request(str(e), param=e.param) from None
        if plan is not None and plan.constraint is not None and params.structured_outputs:
            raise bad_request("tool_choice required or a named function cannot be combined "
                              "with another output constraint", param="tool_choice")
        return plan

    async def _reasoning(self, prompt: list[int], include: bool) -> ChatReasoning | None:
        """The server's reasoning parser and where the prompt leaves the model (read
        from the prompt's text, off the event loop)."""
        name = self.config.reasoning_parser
        if name is None:
            return None
        parser = REASONING_PARSERS.get(name)()
        text = await self.tokenization.decode(prompt)
        return ChatReasoning(parser, parser.prompt_state(text), include)

    def _after_reasoning(self, params: SamplingParams,
                         reasoning: ChatReasoning | None) -> SamplingParams:
        """An output constraint waits for the end of the reasoning (vLLM's engine)."""
        so = params.structured_outputs
        if so is None or reasoning is None or not reasoning.parser.grammar_waits(
                reasoning.state):
            return params
        end = tuple(self.engine.tokenizer.encode(reasoning.parser.end,
                                                 add_special_tokens=False))
        return dataclasses.replace(params, structured_outputs=dataclasses.replace(
            so, reasoning_end_token_ids=end))

    async def _chat_chunks(
        self, prompts: list[list[int]], params: SamplingParams, request_id: str, public_id: str,
        priority: int, tenant: str, model: str, opts: StreamOpts, want_logprobs: bool,
        role: str, plan: ToolPlan | None = None, route: dict[str, Any] | None = None,
        reasoning: ChatReasoning | None = None,
    ) -> AsyncIterator[str]:
        """The role first, then a chunk per engine output (an empty delta while the
        text is not yet decidable or a tool call is being held), as vLLM sends them."""
        rid, created = f"chatcmpl-{public_id}", int(time.time())
        num_out = [0] * params.n
        cached = [0] * params.n
        prompt_len = len(prompts[0])

        def chunk(choice: dict, index: int, first: bool = False) -> str:
            out: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk",
                                   "created": created, "model": model, "choices": [choice],
                                   "usage": None}
            if opts.return_token_ids and first:
                out["prompt_token_ids"] = prompts[0]
            if opts.continuous_usage:
                c = num_out[index]
                out["usage"] = {"prompt_tokens": prompt_len, "completion_tokens": c,
                                "total_tokens": prompt_len + c}
            return _sse(out)

        for i in range(params.n):  # the role comes first, as OpenAI sends it
            yield chunk({"index": i, "delta": {"role": role, "content": ""},
                         "logprobs": None, "finish_reason": None}, i, first=True)
        top_n = params.logprobs or 0
        deltas = ChatDeltas(params.n, plan, reasoning)
        async for d in self.engine.generate(prompts, params, request_id, priority=priority,
                                            tenant=tenant, **(route or {})):
            num_out[d.index] += len(d.token_ids)
            cached[d.index] = d.num_cached_tokens
            lp = None
            if want_logprobs and d.logprobs:
                lp = {"content": [t.model_dump() for t in
                                  self._chat_logprobs(d.logprobs, top_n, opts.name)]}
            delta, finish = deltas.delta(d.index, d.text, bool(d.token_ids), d.finish_reason)
            if not d.token_ids and not delta and lp is None and finish is None:
                continue  # no engine output to report
            choice: dict[str, Any] = {"index": d.index, "delta": delta, "logprobs": lp,
                                      "finish_reason": finish, "stop_reason": d.stop_reason}
            if opts.return_token_ids:
                choice["token_ids"] = d.token_ids
            yield chunk(choice, d.index)
        if opts.include_usage:
            usage = self.with_cached_tokens(_usage_counts(prompts, params.n, num_out),
                                            _cached_tokens(cached, 1))
            yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                        "model": model, "choices": [], "usage": usage.model_dump()})

    def _chat_logprobs(self, lps: list[TokenLogprobs], top_n: int,
                       token_str: Callable[[int], str]) -> list[ChatTokenLogprob]:
        out = []
        for tl in lps:
            s = token_str(tl.token_id)
            top = [TopLogprob(token=token_str(t), logprob=lp, bytes=list(token_str(t).encode()))
                   for t, lp in tl.top[:top_n]]
            out.append(ChatTokenLogprob(token=s, logprob=tl.logprob, bytes=list(s.encode()),
                                        top_logprobs=top))
        return out
