"""What the endpoints send back: SSE events, a streaming response that releases the
request's reservation when it ends, each choice's accumulated output, usage counts."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from iterserve.core.outputs import TokenLogprobs
from iterserve.engine.async_llm import CompletionDelta
from iterserve.entrypoints.guards import bad_request
from iterserve.entrypoints.protocol import UsageInfo

logger = logging.getLogger("iterserve.server")

# Field names are the client's: bound what they can make the server remember and log.
_unknown_fields_logged: set[str] = set()
_MAX_UNKNOWN_FIELDS_LOGGED = 256


def _log_unknown_fields(req: BaseModel) -> None:
    extra = req.model_extra or {}
    if not extra or len(_unknown_fields_logged) >= _MAX_UNKNOWN_FIELDS_LOGGED:
        return
    new = [k[:64] for k in extra if k[:64] not in _unknown_fields_logged]
    new = new[: _MAX_UNKNOWN_FIELDS_LOGGED - len(_unknown_fields_logged)]
    if new:
        _unknown_fields_logged.update(new)
        logger.warning("ignoring unknown request fields: %s", ", ".join(sorted(new)))


# json.dumps escapes the C0 controls but leaves these raw; clients that split an SSE
# body with str.splitlines (httpx's iter_lines does) would cut an event in two.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _sse(obj: Any) -> str:
    data = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    if not data.isascii():
        data = data.translate(_LINE_BREAKS)
    return f"data: {data}\n\n"


async def _wait_for_disconnect(raw: Request) -> None:
    """Returns when the client goes away (uvicorn: receive() yields http.disconnect once
    the body was read and the peer closed)."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


class _ClosingStreamingResponse(StreamingResponse):
    """Runs ``on_close`` when the response ends, however it ends. The body's own
    ``finally`` is not enough: an async generator that never started runs no ``finally``,
    and a server speaking ASGI spec 2.4 makes the first ``send`` raise for a client that
    is already gone, before the body starts (the admission reservation would leak).
    (Under uvicorn, spec 2.3, anyio happens to start the body before cancelling it.)"""

    def __init__(self, content: Any, on_close: Any, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()  # idempotent: abort and release both are


class _Choice:
    """A non-streamed choice, accumulated from deltas."""

    __slots__ = ("finish_reason", "logprobs", "num_cached_tokens", "num_tokens",
                 "prompt_logprobs", "stop_reason", "text", "token_ids")

    def __init__(self) -> None:
        self.text = ""
        self.num_tokens = 0
        self.token_ids: list[int] = []
        self.num_cached_tokens = 0
        self.logprobs: list[TokenLogprobs] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.prompt_logprobs: list[TokenLogprobs] | None = None

    def add(self, d: CompletionDelta) -> None:
        self.num_cached_tokens = d.num_cached_tokens
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
        self.text += d.text
        self.num_tokens += len(d.token_ids)
        self.token_ids.extend(d.token_ids)
        if d.logprobs:
            self.logprobs.extend(d.logprobs)
        if d.finish_reason is not None:
            self.finish_reason = d.finish_reason
            self.stop_reason = d.stop_reason


def _message_dict(m: Any, i: int) -> dict[str, Any]:
    content = m.content
    if isinstance(content, list):
        parts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise bad_request(f"only text content parts are supported, got {part.type!r}",
                                  param=f"messages.{i}.content")
            parts.append(part.text)
        content = "".join(parts)
    if m.role == "tool" and not m.tool_call_id:  # OpenAI's rule: it names the call answered
        raise bad_request(f"Missing required parameter: 'messages.{i}.tool_call_id' (a tool "
                          "message answers the tool call with that id)",
                          param=f"messages.{i}.tool_call_id", code="missing_required_parameter")
    d: dict[str, Any] = {"role": m.role, "content": content or ""}
    if m.tool_calls:
        d["tool_calls"] = m.tool_calls
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        d["name"] = m.name
    return d


def _usage(prompts: list[list[int]], choices: list[_Choice]) -> UsageInfo:
    p = sum(len(x) for x in prompts)
    c = sum(ch.num_tokens for ch in choices)
    return UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)


def _cached_tokens(per_child: list[int], num_prompts: int) -> int:
    """Prefix-cache hits of a request: each prompt's first sample (the others of the same
    prompt hit its blocks and would count one prompt n times)."""
    n = len(per_child) // max(num_prompts, 1)
    return sum(per_child[i * n] for i in range(num_prompts)) if n else 0


def _usage_counts(prompts: list[list[int]], n: int, num_out: list[int]) -> UsageInfo:
    p = sum(len(x) for x in prompts)
    c = sum(num_out)
    return UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)
