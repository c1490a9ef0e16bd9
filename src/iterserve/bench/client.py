"""One streaming request to an OpenAI-compatible server, timed from the client.

Works with any server that speaks the OpenAI API (iterserve, vLLM, SGLang, TGI,
llama.cpp): ``/v1/completions`` or ``/v1/chat/completions``, ``stream: true``
with ``stream_options.include_usage`` so the final chunk carries exact token
counts. Every request shares one ``aiohttp.ClientSession`` (keep-alive
connections), and nothing here raises: HTTP errors, error events inside the
stream, dropped connections and timeouts all come back as a failed output with
an error code.

A server may close an idle keep-alive connection just as the client reuses it
(llama.cpp's server does so after a few requests): the request then fails before
any of its response arrives, so the server never accepted it. Such a request is
sent again (up to ``MAX_KEEPALIVE_RETRIES`` times; the dead connection is dropped)
and counted in ``retries``, not as a failure. A request whose connection was new,
or whose response had begun, is never resent.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

# Resends of one request after a reused connection closed before any response.
MAX_KEEPALIVE_RETRIES = 3


@dataclass(slots=True)
class RequestFuncInput:
    api_url: str
    model: str
    prompt: str | list[int]
    prompt_len: int
    output_len: int
    is_chat: bool = False
    ignore_eos: bool = False
    priority: int | None = None
    tenant: str | None = None
    sampling: dict[str, Any] = field(default_factory=dict)  # temperature, top_p, ...
    extra_body: dict[str, Any] | None = None
    headers: dict[str, str] | None = None


@dataclass(slots=True)
class RequestFuncOutput:
    success: bool = False
    generated_text: str = ""
    prompt_len: int = 0  # the server's usage.prompt_tokens when sent, else the dataset's
    output_tokens: int | None = None  # the server's usage.completion_tokens, when sent
    num_chunks: int = 0  # streamed chunks that carried a token (its text may be empty)
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0  # time.perf_counter() when sent
    error: str = ""
    error_code: str = ""
    retries: int = 0  # resends after a reused keep-alive connection closed unanswered


def keepalive_trace() -> aiohttp.TraceConfig:
    """Marks a request whose connection came from the keep-alive pool (its
    ``trace_request_ctx`` dict gets ``reused: True``); install it on the session."""

    async def reused(_: Any, ctx: Any, __: Any) -> None:
        if isinstance(ctx.trace_request_ctx, dict):
            ctx.trace_request_ctx["reused"] = True

    trace = aiohttp.TraceConfig()
    trace.on_connection_reuseconn.append(reused)
    return trace


async def _post(session: aiohttp.ClientSession, url: str, payload: dict[str, Any],
                headers: dict[str, str], out: RequestFuncOutput) -> aiohttp.ClientResponse:
    """POST until a response's headers arrive; resend only when a reused connection
    closed first (the server never answered that request on it). Sets
    ``out.start_time`` to the send that was answered."""
    while True:
        attempt: dict[str, bool] = {"reused": False}
        out.start_time = time.perf_counter()
        try:
            return await session.post(url, json=payload, headers=headers,
                                      trace_request_ctx=attempt)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
            if not attempt["reused"] or out.retries >= MAX_KEEPALIVE_RETRIES:
                raise
            out.retries += 1


def build_payload(inp: RequestFuncInput) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": inp.model,
        "max_tokens": inp.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if inp.is_chat:
        if not isinstance(inp.prompt, str):
            raise ValueError("token-id prompts need /v1/completions, not chat")
        payload["messages"] = [{"role": "user", "content": inp.prompt}]
    else:
        payload["prompt"] = inp.prompt
    payload.update(inp.sampling)
    # Non-standard fields only when asked for, so strict servers are not upset.
    if inp.ignore_eos:
        payload["ignore_eos"] = True
    if inp.priority is not None:
        payload["priority"] = inp.priority
    if inp.tenant is not None:
        payload["user"] = inp.tenant
    if inp.extra_body:
        payload.update(inp.extra_body)
    return payload


def _carries_token(choice: dict[str, Any], is_chat: bool) -> bool:
    """Whether a streamed choice is a generated token's chunk, as vLLM's bench client
    counts them: a token may decode to no text yet (a partial character, a held-back
    stop prefix) and still time TTFT / ITL; chat's opening chunk (``role``) is not one."""
    if not is_chat:
        return "text" in choice
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return False
    if any(delta.get(k) for k in ("content", "reasoning_content", "reasoning", "tool_calls")):
        return True
    return delta.get("content") == "" and "role" not in delta


def _chunk_text(choice: dict[str, Any], is_chat: bool) -> str:
    if not is_chat:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""


def _error_message(body: bytes) -> str:
    text = body.decode("utf-8", errors="replace")
    try:
        err = json.loads(text).get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
    except (ValueError, AttributeError):
        pass
    return text[:500]


async def request_openai(
    inp: RequestFuncInput,
    session: aiohttp.ClientSession,
) -> RequestFuncOutput:
    """Send one streaming request and time it; never raises for server-side trouble."""
    out = RequestFuncOutput(prompt_len=inp.prompt_len)
    headers = {"Content-Type": "application/json", **(inp.headers or {})}
    if inp.tenant is not None:
        headers["X-Tenant"] = inp.tenant
    payload = build_payload(inp)
    text_parts: list[str] = []
    saw_done = saw_finish = False
    out.start_time = time.perf_counter()
    try:
        resp = await _post(session, inp.api_url, payload, headers, out)
        most_recent = st = out.start_time
        async with resp:
            if resp.status != 200:
                out.error_code = str(resp.status)
                out.error = f"HTTP {resp.status}: {_error_message(await resp.read())}"
                out.latency = time.perf_counter() - st
                return out
            buf = b""
            # Split on newlines ourselves: a network read may hold several SSE events
            # or half of one, and servers end lines with \n or \r\n.
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                buf += data
                *lines, buf = buf.split(b"\n")
                for raw in lines:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue  # blank separator, comment or event: line
                    body = line[5:].strip()
                    if body == b"[DONE]":
                        saw_done = True
                        continue
                    chunk = json.loads(body.decode())  # str: skips encoding sniffing
                    if chunk.get("error"):
                        err = chunk["error"]
                        msg = err.get("message", str(err)) if isinstance(err, dict) else str(err)
                        code = err.get("code") if isinstance(err, dict) else None
                        out.error_code = str(code) if code else "stream"
                        out.error = f"error event in stream: {msg}"
                    for choice in chunk.get("choices") or ():
                        text = _chunk_text(choice, inp.is_chat)
                        if choice.get("finish_reason"):
                            saw_finish = True
                        if not _carries_token(choice, inp.is_chat):
                            continue
                        if out.num_chunks == 0:
                            out.ttft = now - st
                        else:
                            out.itl.append(now - most_recent)
                        most_recent = now
                        out.num_chunks += 1
                        text_parts.append(text)
                    usage = chunk.get("usage")
                    if usage:
                        if usage.get("completion_tokens") is not None:
                            out.output_tokens = int(usage["completion_tokens"])
                        if usage.get("prompt_tokens") is not None:
                            out.prompt_len = int(usage["prompt_tokens"])
        out.latency = time.perf_counter() - st
        out.generated_text = "".join(text_parts)
        if out.error:
            return out
        if not (saw_done or saw_finish):
            out.error_code = "stream"
            out.error = "stream ended without [DONE] or a finish_reason"
            return out
        if out.num_chunks == 0:
            out.ttft = out.latency  # no token chunk at all: the "first token" is the end
        out.success = True
    except TimeoutError:
        out.error_code, out.error = "timeout", "request timed out"
    except aiohttp.ClientPayloadError as e:
        out.error_code, out.error = "connection", f"connection dropped mid-response: {e!r}"
    except aiohttp.ClientError as e:
        out.error_code, out.error = "connection", f"{type(e).__name__}: {e}"
    except (ValueError, KeyError, TypeError) as e:
        out.error_code, out.error = "stream", f"bad stream data: {e!r}"
    except OSError as e:
        out.error_code, out.error = "connection", f"{type(e).__name__}: {e}"
    if not out.success and not out.latency:
        out.latency = time.perf_counter() - out.start_time
    return out
