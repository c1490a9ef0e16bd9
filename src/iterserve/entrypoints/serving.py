"""The OpenAI endpoints' logic (``OpenAIServing``): completions, chat, tokenize,
detokenize, one instance per app; the HTTP app that routes to it is in server.py.
Shared checks and the request path are in serving_base.py; each endpoint family in its
own module, as vLLM splits them."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from iterserve.entrypoints.guards import bad_request
from iterserve.entrypoints.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from iterserve.entrypoints.request_body import read_request
from iterserve.entrypoints.serving_base import (  # ServerConfig, _sse: re-exported
    ServerConfig,
    _message_dict,
    _sse,
)
from iterserve.entrypoints.serving_chat import ChatServing
from iterserve.entrypoints.serving_completion import CompletionServing

__all__ = ["OpenAIServing", "ServerConfig", "_sse"]


class OpenAIServing(CompletionServing, ChatServing):
    """The endpoints' logic; one instance per app."""

    async def tokenize(self, raw: Request) -> Response:
        req = await read_request(raw, TokenizeRequest, self.config.max_request_body_bytes,
                                 self.precheck)
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt and messages", param="prompt")
        limit = self.config.max_tokenize_tokens or self.max_model_len
        if req.messages is not None:
            messages = [_message_dict(m, i) for i, m in enumerate(req.messages)]
            tokens = await self.tokenize_chat(
                messages, add_special_tokens=False, limit=limit,
                add_generation_prompt=req.add_generation_prompt)
        else:
            tokens = await self.tokenize_text(req.prompt or "", field="prompt", limit=limit,
                                              add_special_tokens=req.add_special_tokens)
        strs = [self.engine.token_str(t) for t in tokens] if req.return_token_strs else None
        return JSONResponse(TokenizeResponse(
            count=len(tokens), max_model_len=self.max_model_len, tokens=tokens, token_strs=strs,
        ).model_dump())

    async def detokenize(self, raw: Request) -> Response:
        req = await read_request(raw, DetokenizeRequest, self.config.max_request_body_bytes,
                                 self.precheck)
        self.check_model(req.model)
        vocab = self.engine.vocab_size
        for t in req.tokens:
            if not 0 <= t < vocab:
                raise bad_request(f"tokens must be in [0, {vocab}), got {t}", param="tokens")
        text = await self.tokenization.decode(req.tokens)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

