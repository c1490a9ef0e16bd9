"""Structured outputs: grammars compiled by llguidance, one token bitmask per step.

The engine thread owns one ``StructuredOutputManager``. A request with
``SamplingParams.structured_outputs`` gets a grammar matcher when it is added; before
every forward pass the manager fills one bitmask row for each such request that
samples in that step (``SchedulerOutput.grammar_bitmask``), the runner's sampler masks
those rows' logits, and after the step each matcher consumes its new token. A matcher
that reaches the end of its grammar finishes the request (``stop``). A request whose
grammar waits for the end of its reasoning (``reasoning_end_token_ids``) samples freely,
and feeds its matcher nothing, until its output has produced those tokens.

Compiling a grammar is the expensive part (milliseconds to seconds for large JSON
schemas), so compiled grammars are cached by their text, and the server compiles a
request's grammar at admission, off the engine thread (``compile``): the engine thread
only copies the compiled matcher. Filling a row is a few microseconds to a few hundred
for large vocabularies, done for the sampling rows only.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import numpy as np

from iterserve.core.outputs import EngineCoreOutputs, GrammarBitmask, SchedulerOutput
from iterserve.core.sampling_params import StructuredOutputsParams

# Compiled grammars kept (distinct schemas / regexes / choice lists).
_CACHE_SIZE = 256


def _import_llguidance() -> Any:
    try:
        import llguidance
        import llguidance.hf
        import llguidance.numpy
    except ImportError as e:  # a dependency; a clear message if it was removed
        raise RuntimeError(
            "structured outputs need the 'llguidance' package (pip install llguidance)"
        ) from e
    return llguidance


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for ``params``; ValueError naming the field if malformed."""
    llg = _import_llguidance()
    kind = params.kind
    try:
        if kind in ("json", "json_object"):
            schema: Any = {"type": "object"} if kind == "json_object" else params.json
            if isinstance(schema, str):
                schema = json.loads(schema)
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema must be an object")
            options = {"whitespace_flexible": not params.disable_any_whitespace}
            return str(llg.LLMatcher.grammar_from_json_schema(schema, defaults=options))
        if kind == "regex":
            return str(llg.LLMatcher.grammar_from_regex(params.regex))
        if kind == "choice":
            return str(llg.grammar_from("choice", json.dumps(params.choice)))
        return str(llg.grammar_from("grammar", params.grammar))
    except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"structured_outputs.{kind}: {e}") from None


class StructuredOutputManager:
    """Grammar matchers of the running structured-output requests (engine thread), and a
    cache of compiled grammars that any thread may fill (``compile``)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll_tokenizer: Any = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self.matchers: dict[str, Any] = {}
        # Requests whose grammar starts after their reasoning (no mask yet).
        self.reasoning: dict[str, _ReasoningGate] = {}

    # -- compiling (any thread) -----------------------------------------------------------

    def _tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                llg = _import_llguidance()
                try:
                    self._ll_tokenizer = llg.hf.from_tokenizer(
                        self.tokenizer, n_vocab=self.vocab_size
                    )
                except ValueError as e:
                    raise ValueError(f"structured_outputs: {e}") from None
            return self._ll_tokenizer

    def compile(self, params: StructuredOutputsParams) -> Any:
        """A compiled matcher for ``params`` (cached); ValueError naming the field when the
        schema, regex or grammar is invalid. Safe to call from any thread."""
        text = grammar_text(params)
        with self._lock:
            matcher = self._compiled.get(text)
            if matcher is not None:
                self._compiled.move_to_end(text)
                return matcher
        llg = _import_llguidance()
        tok = self._tokenizer()
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(text, tok)
        if is_error:
            raise ValueError(f"structured_outputs.{params.kind}: {messages[0] if messages else 'invalid'}")
        matcher = llg.LLMatcher(tok, text)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{params.kind}: {matcher.get_error()}")
        with self._lock:
            self._compiled[text] = matcher
            while len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
        return matcher

    # -- per request (engine thread) --------------------------------------------------------

    def add_request(self, request_id: str, params: StructuredOutputsParams) -> None:
        # A compiled matcher is a template: each request walks its own copy.
        self.matchers[request_id] = self.compile(params).deep_copy()
        if params.reasoning_end_token_ids:
            self.reasoning[request_id] = _ReasoningGate(params.reasoning_end_token_ids)

    def drop(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self.matchers.pop(rid, None)
            self.reasoning.pop(rid, None)

    def bitmask(self, sched_out: SchedulerOutput) -> GrammarBitmask | None:
        """Masks for the structured-output requests that sample in this step."""
        if not self.matchers:
            return None
        rows: list[tuple[str, Any]] = []
        for r, n, c in zip(
            sched_out.scheduled_requests,
            sched_out.num_scheduled_tokens,
            sched_out.num_computed_tokens,
        ):
            matcher = self.matchers.get(r.request_id)
            if (matcher is not None and c + n == r.num_tokens
                    and r.request_id not in self.reasoning):
                rows.append((r.request_id, matcher))
        if not rows:
            return None
        llg = _import_llguidance()
        mask = llg.numpy.allocate_token_bitmask(len(rows), self.vocab_size)
        for i, (_, matcher) in enumerate(rows):
            llg.numpy.fill_next_token_bitmask(matcher, mask, i)
        return GrammarBitmask([rid for rid, _ in rows], mask)

    def advance(self, outputs: EngineCoreOutputs) -> list[str]:
        """Feed each matcher its request's new token; returns the ids of unfinished
        requests whose grammar is complete (they end now, with ``stop``). Reads the
        outputs' columns: no per-token objects for the other requests."""
        done: list[str] = []
        finished, sampled = outputs.finished, outputs.sampled
        for rid, matcher in list(self.matchers.items()):
            final = finished.get(rid)
            if final is not None:
                del self.matchers[rid]
                self.reasoning.pop(rid, None)
                continue
            token = sampled.get(rid)
            if token is None:
                continue
            gate = self.reasoning.get(rid)
            if gate is not None:
                if gate.ends_with(token):
                    del self.reasoning[rid]  # the grammar starts with the next token
                continue
            matcher.consume_token(token)
            if matcher.is_stopped() or matcher.is_error():
                done.append(rid)
                del self.matchers[rid]
        return done


class _ReasoningGate:
    """The last tokens of a request's output, until they are the reasoning's end."""

    __slots__ = ("end", "tail")

    def __init__(self, end: tuple[int, ...]) -> None:
        self.end = end
        self.tail: tuple[int, ...] = ()

    def ends_with(self, token: int) -> bool:
        self.tail = (*self.tail, token)[-len(self.end):]
        return self.tail == self.end


def unpack_bitmask(bitmask: Any, vocab_size: int) -> np.ndarray:
    """int32 words -> a bool array ``[rows, vocab_size]`` (tests and the numpy path)."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=-1, bitorder="little")
    return bits[:, :vocab_size].astype(bool)
