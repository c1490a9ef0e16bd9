"""Per-request sampling parameters, validated on creation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(slots=True)
class StructuredOutputsParams:
    """Constrain the output to a language (vLLM's ``structured_outputs``): exactly one of
    a JSON schema (``json``, a dict or its text), a regular expression, a list of
    choices, a grammar (Lark or GBNF) or any JSON object (``json_object``).

    ``disable_any_whitespace``: JSON may not contain whitespace between tokens
    (small models otherwise tend to fill it with blanks).

    ``reasoning_end_token_ids``: the grammar applies only after the output has produced
    these tokens in a row (a reasoning model's ``</think>``, as vLLM's reasoning parsers
    gate structured outputs); until then the output is free. None: from the first token.
    ``compiled`` (engine-side) holds an ``engine.structured_output.CompiledGrammar``,
    which pickles to None: a Ray replica compiles its own.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False
    reasoning_end_token_ids: tuple[int, ...] | None = None
    # The compiled grammar, set by whoever compiled it for this request (the server, at
    # admission), so the engine thread never compiles; never compared.
    compiled: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        ids = self.reasoning_end_token_ids
        if ids is not None:
            if not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
                raise ValueError("structured_outputs.reasoning_end_token_ids must be a "
                                 f"non-empty sequence of token ids, got {ids!r:.80}")
            self.reasoning_end_token_ids = tuple(ids)
        given = [k for k, v in self._fields() if v is not None and v is not False]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of "
                f"{', '.join(STRUCTURED_OUTPUT_KINDS)}, got {', '.join(given) or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema, got {self.json!r:.80}")
        for name, value in (("regex", self.regex), ("grammar", self.grammar)):
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            self.choice = list(self.choice)

    def _fields(self) -> list[tuple[str, object]]:
        return [
            ("json", self.json),
            ("regex", self.regex),
            ("choice", self.choice),
            ("grammar", self.grammar),
            ("json_object", self.json_object),
        ]

    @property
    def kind(self) -> str:
        """Which constraint is set: one of ``STRUCTURED_OUTPUT_KINDS``."""
        return next(k for k, v in self._fields() if v is not None and v is not False)


@dataclass(slots=True)
class SamplingParams:
    """How one request samples and when it stops.

    Every field is checked in ``__post_init__``; a bad value raises ``ValueError``
    whose message starts with the field's name, so API layers can turn it into a
    400 that names the parameter.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    # Log-probabilities of the prompt's tokens (each given the ones before it) with this
    # many alternatives, as vLLM's prompt_logprobs; computed over the whole prompt
    # (such a request takes no prefix-cache hits).
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True
    # Latency targets for --scheduling-policy slo (None: the server's defaults).
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # Token id -> bias added to its logit, in [-100, 100] (OpenAI's logit_bias).
    logit_bias: dict[int, float] | None = None
    # Only these tokens may be sampled.
    allowed_token_ids: list[int] | None = None
    # Words that must not be generated; ``bad_words_token_ids`` are their token
    # sequences, filled by whoever holds the tokenizer (``bad_words_token_ids_for``).
    bad_words: list[str] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] | None = None
    # Tokens batched into each streamed delta, raised to the server's --stream-interval
    # when below it (vLLM's); the first and last deltas go out at once.
    stream_interval: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check_int("n", self.n, lo=1)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, lo=1)
        _check_int("min_tokens", self.min_tokens, lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        _check_float("temperature", self.temperature, lo=0.0)
        _check_float("top_p", self.top_p, lo=0.0, hi=1.0)
        if self.top_p == 0.0:
            raise ValueError("top_p must be in (0, 1], got 0")
        _check_int("top_k", self.top_k, lo=-1)
        if self.top_k == 0:
            raise ValueError("top_k must be -1 (disabled) or >= 1, got 0")
        _check_float("min_p", self.min_p, lo=0.0, hi=1.0)
        if self.seed is not None:
            _check_int("seed", self.seed)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a list of non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, lo=0)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, lo=0)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, lo=0)
        _check_float("repetition_penalty", self.repetition_penalty, lo=0.0)
        if self.repetition_penalty == 0.0:
            raise ValueError("repetition_penalty must be > 0, got 0")
        _check_float("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _check_float("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        for name in ("ttft_slo_ms", "tpot_slo_ms"):
            v = getattr(self, name)
            if v is not None:
                _check_float(name, v, lo=0.0)
                if v == 0.0 or v == float("inf"):
                    raise ValueError(f"{name} must be a positive number of milliseconds, got {v}")
        if self.logit_bias is not None:
            bias: dict[int, float] = {}
            for t, b in self.logit_bias.items():
                _check_int("logit_bias", t, lo=0)
                _check_float("logit_bias", b, lo=-100.0, hi=100.0)
                bias[int(t)] = float(b)
            self.logit_bias = bias
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
            for t in self.allowed_token_ids:
                _check_int("allowed_token_ids", t, lo=0)
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.stream_interval is not None:
            _check_int("stream_interval", self.stream_interval, lo=1)
        self.bad_words = list(self.bad_words or [])
        for w in self.bad_words:
            if not isinstance(w, str) or not w.strip():
                raise ValueError(f"bad_words must be a list of non-empty strings, got {w!r:.80}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def has_logit_controls(self) -> bool:
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids)

    def verify_token_ids(self, vocab_size: int) -> None:
        """ValueError naming the field when a token id is outside the model's vocabulary."""
        fields: list[tuple[str, list[int]]] = [("stop_token_ids", list(self.stop_token_ids))]
        if self.logit_bias:
            fields.append(("logit_bias", list(self.logit_bias)))
        if self.allowed_token_ids:
            fields.append(("allowed_token_ids", list(self.allowed_token_ids)))
        for name, ids in fields:
            for t in ids:
                if t >= vocab_size:
                    raise ValueError(
                        f"{name} holds token id {t}, outside the vocabulary (size {vocab_size})"
                    )

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def _check_int(name: str, value: object, lo: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")


def _check_float(name: str, value: object, lo: float | None = None, hi: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value != value:  # NaN
        raise ValueError(f"{name} must be a number, got NaN")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")


def bad_words_token_ids_for(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """Each bad word's token ids, alone and after a space (how it appears mid-text), as
    vLLM tokenizes them; duplicates dropped (in linear time: a set of the sequences)."""
    seqs: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    texts = [t for word in words for t in (word.lstrip(), " " + word.lstrip())]
    for ids in _encode_texts(tokenizer, texts):
        key = tuple(ids)
        if ids and key not in seen:
            seen.add(key)
            seqs.append(ids)
    return seqs


def _encode_texts(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """``tokenizer.encode(t, add_special_tokens=False)`` for each text. A fast
    tokenizer's backend does them in one ``encode_batch`` (the same ids), without the
    GIL: a thousand ``encode`` calls through transformers are Python that holds it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and texts:
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    return [list(tokenizer.encode(t, add_special_tokens=False)) for t in texts]
