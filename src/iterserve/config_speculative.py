"""``SpeculativeConfig``: vLLM's ``--speculative-config`` JSON, validated.

Its own module so ``config.py`` stays one screen per section; pure Python like it.
:func:`parse_speculative_config` turns the flag's JSON text (or a dict, as
``LLM(speculative_config={...})`` passes it) into the frozen dataclass; a bad key or
value raises ValueError naming the field. docs/speculative-decoding.md is the reference.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model")
# vLLM's other spellings of a method.
_METHOD_ALIASES = {"[ngram]": "ngram", "draft": "draft_model"}
# vLLM's default n-gram window when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Which proposer guesses tokens, how many per step, and the adaptive rule's knobs.

    ``num_speculative_tokens`` is the most drafts per request per step (K); the
    scheduler lowers it per request and step (docs/speculative-decoding.md, "Adaptive
    K") unless ``adaptive`` is off.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 0  # 0 only before __post_init__ fills a default
    # ngram: the n-gram lengths tried, longest first.
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # draft_model: the draft checkpoint (same tokenizer as the target).
    model: str | None = None
    # suffix (SuffixDecoding / arctic-inference names, as vLLM spells them).
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # vLLM's: no speculation while more than this many requests run (None: no cap).
    disable_by_batch_size: int | None = None
    # iterserve's: size K per request and step from measured acceptance and step cost.
    adaptive: bool = True
    # Weight of the newest step in each request's acceptance-rate average (EWMA).
    acceptance_ewma_alpha: float = 0.3
    # Acceptance rate assumed for a request before its first verified draft.
    initial_acceptance_rate: float = 0.6

    def __post_init__(self) -> None:
        method = _METHOD_ALIASES.get(self.method, self.method)
        if method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                f"got {self.method!r}")
        object.__setattr__(self, "method", method)
        k = self.num_speculative_tokens
        if method == "suffix" and k == 0:
            k = self.suffix_decoding_max_tree_depth  # vLLM's default for suffix
        _positive_int("num_speculative_tokens", k)
        object.__setattr__(self, "num_speculative_tokens", k)
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = DEFAULT_PROMPT_LOOKUP
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        _positive_int("prompt_lookup_min", lo)
        _positive_int("prompt_lookup_max", hi)
        assert lo is not None and hi is not None
        if lo > hi:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({lo}) must be <= prompt_lookup_max "
                f"({hi})")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)
        if method == "draft_model" and not self.model:
            raise ValueError(
                "speculative_config.model is required for method 'draft_model' (a checkpoint "
                "directory with the target's tokenizer)")
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative_config.model must be a path, got {self.model!r}")
        _positive_int("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth)
        _positive_int(
            "suffix_decoding_max_cached_requests", self.suffix_decoding_max_cached_requests,
            allow_zero=True)
        _fraction("suffix_decoding_min_token_prob", self.suffix_decoding_min_token_prob)
        _number("suffix_decoding_max_spec_factor", self.suffix_decoding_max_spec_factor)
        if self.suffix_decoding_max_spec_factor <= 0:
            raise ValueError(
                "speculative_config.suffix_decoding_max_spec_factor must be > 0, got "
                f"{self.suffix_decoding_max_spec_factor!r}")
        if self.disable_by_batch_size is not None:
            _positive_int("disable_by_batch_size", self.disable_by_batch_size)
        if not isinstance(self.adaptive, bool):
            raise ValueError(
                f"speculative_config.adaptive must be true or false, got {self.adaptive!r}")
        _fraction("acceptance_ewma_alpha", self.acceptance_ewma_alpha)
        if self.acceptance_ewma_alpha == 0:
            raise ValueError("speculative_config.acceptance_ewma_alpha must be > 0, got 0")
        _fraction("initial_acceptance_rate", self.initial_acceptance_rate)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_FIELDS = {f.name for f in dataclasses.fields(SpeculativeConfig)}


def parse_speculative_config(
    value: str | Mapping[str, Any] | SpeculativeConfig | None,
) -> SpeculativeConfig | None:
    """``--speculative-config`` JSON text, a dict, a config or None -> a config or None.

    vLLM's shorthand is accepted: ``{"model": "ngram", ...}`` means method ngram, and a
    ``model`` without a ``method`` means a draft model.
    """
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        text = value.strip()
        if text.lower() in ("", "none", "null"):
            return None
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config is not valid JSON: {e}") from None
    if not isinstance(value, Mapping):
        raise ValueError(
            f"speculative_config must be a JSON object, got {type(value).__name__}")
    data = dict(value)
    unknown = sorted(set(data) - _FIELDS)
    if unknown:
        raise ValueError(
            f"speculative_config has unknown field(s) {', '.join(unknown)}; known: "
            f"{', '.join(sorted(_FIELDS))}")
    if data.get("model") in ("ngram", "[ngram]"):
        data.pop("model")
        data.setdefault("method", "ngram")
    elif "method" not in data and data.get("model"):
        data["method"] = "draft_model"
    if "method" not in data:
        raise ValueError(
            f"speculative_config.method is required (one of {', '.join(SPECULATIVE_METHODS)})")
    return SpeculativeConfig(**data)


def _positive_int(name: str, value: object, *, allow_zero: bool = False) -> None:
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(
            f"speculative_config.{name} must be an integer >= {low}, got {value!r}")


def _number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(f"speculative_config.{name} must be a number, got {value!r}")


def _fraction(name: str, value: object) -> None:
    _number(name, value)
    assert isinstance(value, (int, float))
    if not 0 <= value <= 1:
        raise ValueError(f"speculative_config.{name} must be in [0, 1], got {value!r}")
