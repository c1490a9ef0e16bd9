"""Request and response bodies of the OpenAI-compatible API (and vLLM's extras).

Requests accept the fields OpenAI's and vLLM's clients send; unknown fields are
ignored (and logged by the server), as vLLM does, so tools written for vLLM work
unchanged. Range checks live in ``SamplingParams`` (one place, messages that
start with the field's name); these models check types and shapes only.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIBaseModel(BaseModel):
    # Unknown fields are kept (not rejected) so the server can name them in a log line.
    model_config = ConfigDict(extra="allow")


class RequestModel(OpenAIBaseModel):
    """A request body: strict types, as OpenAI's API parses them (no "5" or true for an
    integer, no [true, false] for token ids, no string for a number)."""

    model_config = ConfigDict(extra="allow", strict=True)


# A JSON number that is finite: 1e400 parses as infinity, which no sampler can use.
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]

# The roles OpenAI's API defines; any other string (or one holding a template's markers)
# would be rendered into the prompt verbatim.
ChatRole = Literal["system", "developer", "user", "assistant", "tool"]


# --- errors ------------------------------------------------------------------------


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# --- requests ----------------------------------------------------------------------


class StreamOptions(RequestModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingFields(RequestModel):
    """Sampling fields shared by completions and chat (OpenAI's plus vLLM's extras)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: FiniteFloat | None = None
    top_p: FiniteFloat | None = None
    top_k: int | None = None
    min_p: FiniteFloat | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    best_of: int | None = None
    presence_penalty: FiniteFloat | None = None
    frequency_penalty: FiniteFloat | None = None
    repetition_penalty: FiniteFloat | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Parsed for vLLM's clients, read nowhere (docs/vllm-compat.md: accepted, no effect).
    spaces_between_special_tokens: bool = Field(
        default=True, json_schema_extra={"no_effect": "not passed to the detokenizer: "
                                         "special tokens are spaced as the tokenizer decodes "
                                         "them"})
    logit_bias: dict[str, FiniteFloat] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # Keep only the prompt's last k tokens (-1: as many as the context allows).
    truncate_prompt_tokens: int | None = None
    use_beam_search: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's: tokens batched into each streamed chunk (raised to --stream-interval).
    stream_interval: int | None = None
    echo: bool = False
    # The tenant for fair-share scheduling (an X-Tenant header overrides it).
    user: str | None = None
    # vLLM's priority: lower values are served first under --scheduling-policy priority.
    priority: int = 0
    # (iterserve) latency targets for --scheduling-policy slo; default: the server's.
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    # vLLM's: the request's id (as X-Request-Id, which wins when both are sent).
    request_id: str | None = None
    # vLLM's: logprobs of the prompt's tokens (this many alternatives each); not streamed.
    prompt_logprobs: int | None = None
    # vLLM's: logprobs name their tokens "token_id:N" (for tokens that are not valid text).
    return_tokens_as_token_ids: bool | None = None
    # vLLM's: the response carries prompt_token_ids and each choice's token_ids.
    return_token_ids: bool | None = None
    # vLLM's cache_salt: requests share prefix-cache blocks only with equal salts.
    cache_salt: str | None = Field(default=None, min_length=1)
    # Structured outputs (entrypoints/structured.py): vLLM's field and OpenAI's.
    structured_outputs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


class ContentPart(RequestModel):
    type: str
    text: str | None = None


class ChatMessage(RequestModel):
    role: ChatRole
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # An assistant turn's tool calls, and a tool turn's answer to one of them.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's: with a reasoning parser, false leaves the reasoning out of the reply.
    include_reasoning: bool = True


class TokenizeRequest(RequestModel):
    """vLLM's /tokenize: either ``prompt`` or chat ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


# --- responses ---------------------------------------------------------------------


class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: int | None = None


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # vLLM's: prompt tokens served from the prefix cache, with
    # --enable-prompt-tokens-details and only when some were.
    prompt_tokens_details: PromptTokenUsageInfo | None = None


class PromptLogprob(OpenAIBaseModel):
    """vLLM's shape of one prompt logprob entry (keyed by token id)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM's extras, with return_token_ids / prompt_logprobs.
    token_ids: list[int] | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogProbs(OpenAIBaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    # With --reasoning-parser: vLLM's ``reasoning``, and its older name (same text).
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatCompletionChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None
    # vLLM's extras, with prompt_logprobs / return_token_ids.
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    prompt_token_ids: list[int] | None = None


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "iterserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
