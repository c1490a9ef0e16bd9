"""``ServerConfig``: the HTTP server's settings (the engine's live in ``EngineConfig``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from iterserve.engine.background import BACKGROUND_NICE, BACKGROUND_POLICIES, BACKGROUND_POLICY
from iterserve.entrypoints.cache_scope import PREFIX_CACHING_SCOPES
from iterserve.entrypoints.reasoning import REASONING_PARSERS
from iterserve.entrypoints.tool_parsers import TOOL_PARSERS


@dataclass(slots=True)
class ServerConfig:
    """HTTP-side settings (the engine's live in EngineConfig)."""

    served_model_names: list[str] = field(default_factory=lambda: ["iterserve"])
    # One key or several (any of them is accepted); None: no authentication.
    api_key: str | list[str] | None = None
    # Admission control: caps on what is admitted and not finished (queued or running).
    # None = no cap. A request of n samples over p prompts counts n * p requests.
    max_num_queued_requests: int | None = None
    # Tokens of work admitted: (prompt + max_tokens) per sample.
    max_num_queued_tokens: int | None = None
    reject_status_code: int = 429  # some load balancers retry only on 503
    retry_after_s: int = 1
    # Request limits against abuse (each a 400 naming the field).
    max_request_body_bytes: int = 8 * 1024 * 1024
    max_n: int = 16
    max_logprobs: int = 20
    max_stop: int = 16
    max_prompts: int = 64  # prompts in one batched completions request
    max_chat_messages: int = 4096  # messages in one chat (or /tokenize) request
    # bad_words: how many, and their total UTF-8 bytes (each word is tokenized twice,
    # off the event loop, and matched every step).
    max_bad_words: int = 1024
    max_bad_words_bytes: int = 64 * 1024
    # Structured outputs (engine/grammar_limits.py): the constraint's size, its compile's
    # time limit, the compile threads, and the compiled-grammar cache's bytes.
    max_structured_output_bytes: int = 128 * 1024
    structured_outputs_compile_timeout_s: float = 10.0
    structured_outputs_compile_threads: int = 1
    structured_outputs_cache_bytes: int = 32 * 1024 * 1024
    # Niceness added to the threads preparing requests (large bodies, long prompts,
    # bad_words, grammars: engine/background.py), so the engine and the event loop
    # preempt them. 0: normal priority.
    background_nice: int = BACKGROUND_NICE
    # How those threads yield: "idle" (SCHED_IDLE: only on cycles nothing else wants)
    # or "nice" (the niceness alone).
    background_policy: str = BACKGROUND_POLICY
    # Largest max_tokens a request may ask for (None: only the context length bounds it).
    max_tokens_limit: int | None = None
    # Most tokens /tokenize answers with (None: the context length).
    max_tokenize_tokens: int | None = None
    # Characters one token covers at most, for refusing a too-long prompt before
    # tokenizing it (None: from the tokenizer's vocabulary; 0: no such check).
    max_chars_per_token: float | None = None
    # Tool calling: tool_choice "auto" needs both (vLLM's --enable-auto-tool-choice and
    # --tool-call-parser); required and named choices work without them.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # vLLM's --reasoning-parser: split <think>...</think> into message.reasoning
    # (entrypoints/reasoning.py).
    reasoning_parser: str | None = None
    # Test-only endpoints (/_test/fault): never enable in production.
    enable_test_hooks: bool = False
    # uvicorn's graceful shutdown lets in-flight requests finish first; then the rest abort.
    shutdown_drain_timeout_s: float = 5.0
    # Who shares prefix-cache blocks: "global" or "tenant" (entrypoints/cache_scope.py).
    prefix_caching_scope: str = "global"
    # vLLM's: report usage.prompt_tokens_details.cached_tokens.
    enable_prompt_tokens_details: bool = False
    # vLLM's --chat-template (the template's text, used instead of the tokenizer's) and
    # --trust-request-chat-template (a request's own template is code: refused without it).
    chat_template: str | None = None
    trust_request_chat_template: bool = False
    # The chat reply's role when add_generation_prompt is true (vLLM's --response-role).
    response_role: str = "assistant"
    # Every request's logprobs name tokens "token_id:N" (vLLM's flag; also a request field).
    return_tokens_as_token_ids: bool = False
    # vLLM's --enable-log-requests / --max-log-len (None: the whole prompt).
    enable_log_requests: bool = False
    max_log_len: int | None = None
    # CORS (vLLM's flags, Starlette's CORSMiddleware); no origins: no CORS headers.
    allowed_origins: list[str] = field(default_factory=list)
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    # vLLM's --default-chat-template-kwargs (a request's own keys win).
    default_chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's --enable-force-include-usage: usage on every stream chunk, whatever
    # stream_options says.
    enable_force_include_usage: bool = False
    # vLLM's --disable-fastapi-docs: no /docs, /redoc, /openapi.json.
    disable_fastapi_docs: bool = False

    @property
    def grammar_limits(self) -> Any:
        """The structured-output limits as the engine's ``GrammarLimits``."""
        from iterserve.engine.grammar_limits import GrammarLimits

        return GrammarLimits(
            max_source_bytes=self.max_structured_output_bytes,
            compile_timeout_s=self.structured_outputs_compile_timeout_s,
            compile_threads=self.structured_outputs_compile_threads,
            cache_bytes=self.structured_outputs_cache_bytes,
        )

    @property
    def api_keys(self) -> list[str]:
        keys = [self.api_key] if isinstance(self.api_key, str) else list(self.api_key or [])
        return [k for k in keys if k]

    def __post_init__(self) -> None:
        for name in ("max_bad_words", "max_bad_words_bytes", "max_chat_messages"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.background_nice <= 19:
            raise ValueError(f"background_nice must be in 0..19, got {self.background_nice}")
        if self.background_policy not in BACKGROUND_POLICIES:
            raise ValueError(f"background_policy must be one of "
                             f"{', '.join(BACKGROUND_POLICIES)}, got {self.background_policy!r}")
        self.grammar_limits  # noqa: B018 (validates the structured-output limits)
        if self.prefix_caching_scope not in PREFIX_CACHING_SCOPES:
            raise ValueError(f"prefix_caching_scope must be one of "
                             f"{', '.join(PREFIX_CACHING_SCOPES)}, got {self.prefix_caching_scope!r}")
        if self.tool_call_parser is not None:
            TOOL_PARSERS.check(self.tool_call_parser)
        if self.reasoning_parser is not None:
            REASONING_PARSERS.check(self.reasoning_parser)
