"""What every OpenAI endpoint shares (``ServingBase``): the server's settings, the common
checks (model, engine alive, sampling fields, context length), running a request to
completion or as an SSE stream with the admission reservation released exactly once.
The endpoints themselves are in serving_completion.py and serving_chat.py, put together
as ``OpenAIServing`` in serving.py.

Request path: read the body (size-capped) -> validate (400 naming the field) ->
model (404) -> engine alive (503) -> admission: reserve request slots (429) ->
tokenize off the loop -> context length (400) -> reserve queued tokens (429) ->
``AsyncLLM.generate`` -> JSON or SSE. Every step that can refuse does so before the
engine sees the request; the reservation is released exactly once, when the
response ends (or the client goes away).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from iterserve.core.sampling_params import SamplingParams, StructuredOutputsParams
from iterserve.engine.async_llm import (
    AsyncLLM,
    EngineDeadError,
    EngineStepError,
    RequestRejectedError,
)
from iterserve.engine.background import (
    keep_tokenizers_on_caller,
    set_background_nice,
    set_background_policy,
)
from iterserve.engine.exceptions import RequestRefusedError
from iterserve.engine.tokenization import ChatContentError, PromptTokenizer, PromptTooLongError
from iterserve.entrypoints.cache_scope import effective_cache_salt
from iterserve.entrypoints.guards import (
    Admission,
    APIError,
    Reservation,
    bad_request,
    engine_dead,
    param_of,
    step_failed,
)
from iterserve.entrypoints.protocol import (
    PromptTokenUsageInfo,
    SamplingFields,
    UsageInfo,
)
from iterserve.entrypoints.request_body import check_list_sizes, check_prompt_lists
from iterserve.entrypoints.request_fields import (
    check_bad_words,
    check_prompt_logprobs,
    client_request_id,
    log_request,
    token_namer,
)
from iterserve.entrypoints.responses import (
    _cached_tokens,
    _Choice,
    _ClosingStreamingResponse,
    _log_unknown_fields,
    _message_dict,
    _sse,
    _usage,
    _usage_counts,
    _wait_for_disconnect,
)
from iterserve.entrypoints.server_config import ServerConfig
from iterserve.entrypoints.structured import (
    StructuredFieldError,
    compile_structured,
    structured_outputs_of,
)

logger = logging.getLogger("iterserve.server")

# Re-exported: the endpoints and server.py import these from here.
__all__ = [
    "ServerConfig", "ServingBase", "_Choice", "_ClosingStreamingResponse", "_cached_tokens",
    "_log_unknown_fields", "_message_dict", "_sse", "_usage", "_usage_counts",
    "_wait_for_disconnect", "too_long",
]


class ServingBase:
    """State and checks the endpoints share; see ``OpenAIServing``."""

    def __init__(self, engine: AsyncLLM, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.admission = Admission(config, engine.metrics)
        self.max_model_len = engine.max_model_len
        # Request preparation below the engine's priority, on the threads that ask for
        # it (engine/background.py); the pools start their threads on first use.
        set_background_nice(config.background_nice)
        set_background_policy(config.background_policy)
        keep_tokenizers_on_caller()
        self.tokenization = PromptTokenizer(engine.tokenizer,
                                            max_chars_per_token=config.max_chars_per_token)
        # List fields capped before validation (request_body.py): a list of token ids
        # longer than the vocabulary only repeats ids; a conversation past the cap.
        vocab = (engine.vocab_size, "the vocabulary's size: longer lists repeat ids")
        self.list_caps: dict[str, tuple[int, str]] = {
            "messages": (config.max_chat_messages, "--max-chat-messages"),
            "allowed_token_ids": vocab, "stop_token_ids": vocab, "logit_bias": vocab,
            "tokens": (max(self.max_model_len, config.max_tokenize_tokens or 0),
                       "the context length"),  # /detokenize
        }
        grammars = getattr(getattr(engine, "engine_core", None), "structured_outputs", None)
        if grammars is not None:
            grammars.configure(config.grammar_limits)

    def precheck(self, body: Any) -> None:
        """Caps checked on the parsed JSON, before validation (request_body.py)."""
        check_list_sizes(body, self.list_caps)
        check_prompt_lists(body, self.config.max_prompts, self.max_model_len)
        words = body.get("bad_words") if isinstance(body, dict) else None
        if isinstance(words, list):  # over the caps: refused before validating the words
            check_bad_words(words, self.config.max_bad_words, self.config.max_bad_words_bytes)

    # -- tokenization (bounded: see engine/tokenization.py) -------------------------------

    async def tokenize_text(self, text: str, *, add_special_tokens: bool, field: str,
                            limit: int | None = None, keep_last: int | None = None) -> list[int]:
        if keep_last is not None:  # truncate_prompt_tokens: only the text's tail is read
            return await self.tokenization.encode_tail(
                text, add_special_tokens=add_special_tokens, keep=keep_last)
        limit = self.max_model_len if limit is None else limit
        try:
            return await self.tokenization.encode(
                text, add_special_tokens=add_special_tokens, limit=limit)
        except PromptTooLongError as e:
            raise too_long(e, field) from None

    async def tokenize_chat(self, messages: list[dict[str, Any]], *, add_special_tokens: bool,
                            limit: int | None = None, keep_last: int | None = None,
                            **template_kwargs: Any) -> list[int]:
        limit = self.max_model_len if limit is None else limit
        if template_kwargs.get("chat_template") is None and self.config.chat_template:
            template_kwargs["chat_template"] = self.config.chat_template  # --chat-template
        if self.config.default_chat_template_kwargs:  # a request's own keys win
            template_kwargs["chat_template_kwargs"] = {
                **self.config.default_chat_template_kwargs,
                **(template_kwargs.get("chat_template_kwargs") or {})}
        try:
            return await self.tokenization.encode_chat(
                messages, add_special_tokens=add_special_tokens, limit=limit, keep=keep_last,
                **template_kwargs)
        except PromptTooLongError as e:
            raise too_long(e, "messages") from None
        except ChatContentError as e:
            raise bad_request(str(e), param="messages") from None
        except Exception as e:  # a template error is the caller's input
            raise bad_request(f"could not apply the chat template: {e}",
                              param="messages") from None

    # -- common checks ----------------------------------------------------------------

    def check_model(self, name: str | None) -> str:
        names = self.config.served_model_names
        if name is None or name in names:
            return names[0] if name is None else name
        raise APIError(
            404,
            f"The model '{name}' does not exist. Available: {', '.join(names)}.",
            param="model",
            code="model_not_found",
        )

    def check_alive(self) -> None:
        try:
            self.engine.check_health()
        except EngineDeadError as e:
            raise engine_dead(e) from None

    async def sampling_params(self, req: SamplingFields, *, max_tokens: int | None,
                              logprobs: int | None,
                              logprobs_param: str = "logprobs") -> SamplingParams:
        """The request's SamplingParams, checked (400 naming the field), with its
        bad_words tokenized and its grammar compiled, both off the event loop, each
        after the caps that bound its cost."""
        params, found = self._sampling_params(req, max_tokens=max_tokens, logprobs=logprobs,
                                              logprobs_param=logprobs_param)
        if params.bad_words:
            params.bad_words_token_ids = await self.engine.bad_words_token_ids(
                params.bad_words)
        if found is not None:
            await self.compile_constraint(found[1], found[0])
        return params

    def _sampling_params(
        self, req: SamplingFields, *, max_tokens: int | None, logprobs: int | None,
        logprobs_param: str,
    ) -> tuple[SamplingParams, tuple[str, StructuredOutputsParams] | None]:
        cfg = self.config
        d = self.engine.sampling_defaults  # the model's generation_config.json
        if d.get("max_tokens") is not None:  # as vLLM: a default and a cap
            max_tokens = min(max_tokens or d["max_tokens"], d["max_tokens"])
        if req.n > cfg.max_n:
            raise bad_request(f"n must be <= {cfg.max_n}, got {req.n}", param="n")
        if (max_tokens is not None and cfg.max_tokens_limit is not None
                and max_tokens > cfg.max_tokens_limit):
            raise bad_request(f"max_tokens must be <= {cfg.max_tokens_limit}, got {max_tokens}",
                              param="max_tokens")
        if logprobs is not None and logprobs > cfg.max_logprobs:
            raise bad_request(f"{logprobs_param} must be <= {cfg.max_logprobs}, got {logprobs}",
                              param=logprobs_param)
        if req.seed is not None and not -(2**63) <= req.seed < 2**63 - cfg.max_n:
            raise bad_request("seed must fit in a signed 64-bit integer", param="seed")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > cfg.max_stop:
            raise bad_request(f"stop may hold at most {cfg.max_stop} strings, got {len(stop)}",
                              param="stop")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of other than n is not supported", param="best_of")
        if req.use_beam_search:
            raise bad_request("use_beam_search is not supported", param="use_beam_search")
        if req.min_tokens >= self.max_model_len:
            raise bad_request(f"min_tokens must be < the model's context length "
                              f"({self.max_model_len}), got {req.min_tokens}",
                              param="min_tokens", code="context_length_exceeded")
        check_prompt_logprobs(req.prompt_logprobs, req.stream, cfg.max_logprobs)
        check_bad_words(req.bad_words, cfg.max_bad_words, cfg.max_bad_words_bytes)
        logit_bias = None
        if req.logit_bias is not None:
            try:
                logit_bias = {int(k): v for k, v in req.logit_bias.items()}
            except ValueError:
                raise bad_request("logit_bias keys must be token ids", param="logit_bias") from None
        try:
            found = structured_outputs_of(req)
        except StructuredFieldError as e:
            raise bad_request(str(e), param=e.param) from None
        top_k = req.top_k if req.top_k is not None else d.get("top_k")
        if top_k is None or top_k == 0:  # vLLM: 0 and -1 both disable top-k
            top_k = -1
        try:
            params = SamplingParams(
                n=req.n,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                temperature=_given(req.temperature, d, "temperature", 1.0),
                top_p=_given(req.top_p, d, "top_p", 1.0),
                top_k=top_k,
                min_p=_given(req.min_p, d, "min_p", 0.0),
                seed=req.seed,
                stop=stop,
                stop_token_ids=list(req.stop_token_ids or []),
                include_stop_str_in_output=req.include_stop_str_in_output,
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                repetition_penalty=_given(req.repetition_penalty, d, "repetition_penalty", 1.0),
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                skip_special_tokens=req.skip_special_tokens,
                ttft_slo_ms=req.ttft_slo_ms,
                tpot_slo_ms=req.tpot_slo_ms,
                structured_outputs=found[1] if found else None,
                logit_bias=logit_bias,
                allowed_token_ids=req.allowed_token_ids,
                bad_words=list(req.bad_words or []),
                prompt_logprobs=req.prompt_logprobs,
                stream_interval=req.stream_interval,
            )
            params.verify_token_ids(self.engine.vocab_size)
        except ValueError as e:
            raise bad_request(str(e), param=param_of(e)) from None
        return params, found

    def truncation(self, k: int | None, params: SamplingParams) -> int | None:
        """How many of each prompt's last tokens ``truncate_prompt_tokens`` keeps (None:
        all). -1 keeps what fits beside the completion (``max_model_len`` minus
        ``max_tokens``, or minus ``min_tokens`` / 1 when max_tokens is open): vLLM keeps
        ``max_model_len``, which leaves no room for any output and so always fails the
        context check."""
        if k is None:
            return None
        limit = self.max_model_len
        if k == -1:
            room = params.max_tokens if params.max_tokens is not None else max(
                1, params.min_tokens)
            return max(1, limit - room)
        if k < 1:
            raise bad_request("truncate_prompt_tokens must be -1 or >= 1",
                              param="truncate_prompt_tokens")
        if k > limit:
            raise bad_request(f"truncate_prompt_tokens must be <= the model's context length "
                              f"({limit}), got {k}", param="truncate_prompt_tokens")
        return k

    @staticmethod
    def truncate_prompts(prompts: list[list[int]], keep: int | None) -> list[list[int]]:
        return prompts if keep is None else [p[-keep:] for p in prompts]

    async def compile_constraint(self, params: StructuredOutputsParams, param: str) -> None:
        try:
            await compile_structured(self.engine, (param, params))
        except StructuredFieldError as e:
            raise bad_request(str(e), param=e.param) from None

    def check_length(self, prompts: list[list[int]], max_tokens: int | None, field: str,
                     min_tokens: int = 0) -> None:
        limit = self.max_model_len
        vocab = self.engine.vocab_size
        for p in prompts:
            if not p:
                raise bad_request(f"{field} must not be empty", param=field)
            if min(p) < 0 or max(p) >= vocab:
                raise bad_request(f"{field} token ids must be in [0, {vocab})", param=field)
            n = len(p)
            if n >= limit or (max_tokens is not None and n + max_tokens > limit):
                total = n + (max_tokens or 1)
                raise APIError(
                    400,
                    f"This model's maximum context length is {limit} tokens. However, you "
                    f"requested {total} tokens ({n} in the {field}, {max_tokens or 1} in the "
                    f"completion). Please reduce the length of the {field} or completion.",
                    param=field if n >= limit or max_tokens is None else "max_tokens",
                    code="context_length_exceeded",
                )
            if n + min_tokens > limit:  # max_tokens open: the context leaves too little
                raise APIError(
                    400,
                    f"min_tokens ({min_tokens}) is more than the context leaves after the "
                    f"{field}: this model's maximum context length is {limit} tokens and the "
                    f"{field} has {n}.",
                    param="min_tokens", code="context_length_exceeded",
                )

    def request_ids(self, raw: Request, body_id: str | None = None) -> tuple[str, str]:
        """(public id, engine id). The public id is the client's ``X-Request-Id``, else
        the body's ``request_id``, when it sends one; the engine id adds a random suffix,
        so two clients that pick the same id (or one that collides with another request's
        child ids) never share engine state."""
        given = client_request_id(raw.headers.get("x-request-id"), body_id)
        if given is None:
            rid = self.engine.new_request_id()
            return rid, rid
        return given[0], f"{given[0]}-{uuid.uuid4().hex}"

    def token_namer(self, req: SamplingFields) -> Callable[[int], str]:
        as_ids = bool(req.return_tokens_as_token_ids or self.config.return_tokens_as_token_ids)
        return token_namer(self.engine.token_str, as_ids)

    def log_request(self, public_id: str, prompts: list[list[int]], text: str | None,
                    params: SamplingParams) -> None:
        if self.config.enable_log_requests:
            log_request(public_id, prompts, text, params, self.config.max_log_len)

    @staticmethod
    def tenant(raw: Request, req: SamplingFields) -> str:
        return raw.headers.get("x-tenant") or req.user or "default"

    def routing(self, raw: Request, req: SamplingFields) -> dict[str, Any]:
        """What the engine (or a cluster's router) keys a request by: its prefix-cache salt
        and its session (``X-Session-Id``, else ``user``: a router's affinity hint)."""
        return {"cache_salt": self.cache_salt(raw, req),
                "session_key": raw.headers.get("x-session-id") or req.user}

    def cache_salt(self, raw: Request, req: SamplingFields) -> str | None:
        return effective_cache_salt(
            self.config.prefix_caching_scope, raw.headers, req.user, req.cache_salt
        )

    def with_cached_tokens(self, usage: UsageInfo, cached_tokens: int) -> UsageInfo:
        """vLLM's ``prompt_tokens_details``: shown when enabled and some prompt tokens hit
        the prefix cache. Hits come only from blocks under the request's own salt, so with
        --prefix-caching-scope tenant they are the owner's own (see cache_scope.py)."""
        if self.config.enable_prompt_tokens_details and cached_tokens:
            usage.prompt_tokens_details = PromptTokenUsageInfo(cached_tokens=cached_tokens)
        return usage

    # -- running a request ----------------------------------------------------------------

    async def collect(
        self,
        raw: Request,
        prompts: list[list[int]],
        params: SamplingParams,
        request_id: str,
        priority: int,
        tenant: str,
        route: dict[str, Any] | None = None,
    ) -> list[_Choice]:
        """Run to completion; abort if the client disconnects first."""
        choices = [_Choice() for _ in range(len(prompts) * params.n)]

        async def run() -> None:
            async for d in self.engine.generate(
                prompts, params, request_id, priority=priority, tenant=tenant, **(route or {}),
            ):
                choices[d.index].add(d)

        task = asyncio.ensure_future(run())
        watch = asyncio.ensure_future(_wait_for_disconnect(raw))
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not task.done():  # the client left, or this handler was cancelled
                task.cancel()
                self.engine.abort(request_id)
                with contextlib.suppress(BaseException):
                    await task
        if not task.done() or task.cancelled():
            raise APIError(499, "client disconnected", code="client_closed_request")
        task.result()  # re-raise an engine error
        return choices

    async def run_engine_errors(self, coro: Any) -> Any:
        try:
            return await coro
        except EngineDeadError as e:
            raise engine_dead(e) from None
        except EngineStepError as e:
            raise step_failed(e) from None
        except RequestRefusedError as e:  # --slo-admission: the target is out of reach now
            raise APIError(429, str(e), type="rate_limit_error", param="ttft_slo_ms",
                           code="slo_unattainable") from None
        except RequestRejectedError as e:
            raise bad_request(str(e), param=param_of(e)) from None

    def stream(
        self,
        chunks: AsyncIterator[str],
        reservation: Reservation,
        request_id: str,
        public_id: str,
    ) -> StreamingResponse:
        engine = self.engine

        async def body() -> AsyncIterator[str]:
            try:
                async for chunk in chunks:
                    yield chunk
            except (EngineDeadError, EngineStepError, RequestRejectedError) as e:
                # Headers are sent: the error travels as an event, then [DONE].
                if isinstance(e, EngineDeadError):
                    err = engine_dead(e)
                elif isinstance(e, EngineStepError):
                    err = step_failed(e)
                else:
                    err = bad_request(str(e), param=param_of(e))
                yield _sse(err.body())
            except Exception as e:  # never a broken stream without a word
                logger.exception("stream %s failed", request_id)
                yield _sse(APIError(500, f"internal error: {e}", type="server_error").body())
            finally:
                engine.abort(request_id)
                reservation.release()
            yield "data: [DONE]\n\n"

        def on_close() -> None:
            engine.abort(request_id)
            reservation.release()

        return _ClosingStreamingResponse(
            body(), on_close, media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                     "X-Request-Id": public_id},
        )


def _given(value: Any, defaults: dict[str, Any], name: str, fallback: Any) -> Any:
    """The request's value, else the model's default, else the API's."""
    if value is not None:
        return value
    return defaults.get(name, fallback)


def too_long(e: PromptTooLongError, field: str) -> APIError:
    return APIError(
        400,
        f"This model's maximum context length is {e.limit} tokens. However, the {field} "
        f"has {'' if e.exact else 'at least '}{e.num_tokens} tokens. Please reduce the "
        f"length of the {field}.",
        param=field,
        code="context_length_exceeded",
    )
