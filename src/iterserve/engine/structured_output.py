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
schemas). The server compiles a request's grammar at admission, on a bounded pool of its
own with a time limit (``engine/grammar_pool.py``), after checking its size
(``engine/grammar_limits.py``), and hands the compiled grammar to the engine with the
request (``StructuredOutputsParams.compiled``): the engine thread only copies it.
Compiled grammars are also cached by their text, in an LRU bounded by (estimated) bytes.
Filling a row is a few microseconds to a few hundred for large vocabularies, done for
the sampling rows only.
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
from iterserve.engine.grammar_limits import (
    GrammarLimits,
    check_source_size,
    clean_error,
    estimated_bytes,
    find_ref_loop,
)
from iterserve.model.heap import malloc_trim


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
            loop = find_ref_loop(schema)
            if loop is not None:
                raise ValueError(f"the schema's $ref loop {' -> '.join(loop)[:300]} defines "
                                 "no value")
            options = {"whitespace_flexible": not params.disable_any_whitespace}
            return str(llg.LLMatcher.grammar_from_json_schema(schema, defaults=options))
        if kind == "regex":
            return str(llg.LLMatcher.grammar_from_regex(params.regex))
        if kind == "choice":
            return str(llg.grammar_from("choice", json.dumps(params.choice)))
        return str(llg.grammar_from("grammar", params.grammar))
    except (ValueError, TypeError, RecursionError) as e:  # json.JSONDecodeError: ValueError
        raise ValueError(f"structured_outputs.{kind}: {clean_error(str(e))}") from None


class CompiledGrammar:
    """A compiled grammar (``matcher``, a template each request copies) and its estimated
    bytes. It travels with its request inside the process; pickled (to a Ray replica)
    it becomes None, and the replica compiles its own."""

    __slots__ = ("matcher", "nbytes")

    def __init__(self, matcher: Any, nbytes: int) -> None:
        self.matcher = matcher
        self.nbytes = nbytes

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (_none, ())


def _none() -> None:
    return None


class GrammarCache:
    """Compiled grammars by text, least recently used evicted past ``max_bytes``
    (estimated). Thread-safe."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, CompiledGrammar] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, text: str) -> CompiledGrammar | None:
        with self._lock:
            found = self._entries.get(text)
            if found is not None:
                self._entries.move_to_end(text)
            return found

    def put(self, text: str, compiled: CompiledGrammar) -> int:
        """Keep ``compiled`` (unless it alone is over the budget); returns the bytes
        evicted."""
        evicted = 0
        with self._lock:
            if compiled.nbytes > self.max_bytes or text in self._entries:
                return 0
            self._entries[text] = compiled
            self.nbytes += compiled.nbytes
            while self.nbytes > self.max_bytes:
                _, old = self._entries.popitem(last=False)
                self.nbytes -= old.nbytes
                evicted += old.nbytes
        return evicted

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.nbytes = 0


class StructuredOutputManager:
    """Grammar matchers of the running structured-output requests (engine thread), and a
    cache of compiled grammars that any thread may fill (``compile``)."""

    def __init__(self, tokenizer: Any, vocab_size: int,
                 limits: GrammarLimits | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll_tokenizer: Any = None
        self._lock = threading.Lock()
        self.limits = limits or GrammarLimits()
        self.cache = GrammarCache(self.limits.cache_bytes)
        self.matchers: dict[str, Any] = {}
        # Requests whose grammar starts after their reasoning (no mask yet).
        self.reasoning: dict[str, _ReasoningGate] = {}
        self.pool: Any = None  # engine.grammar_pool.GrammarPool, made on first use

    def configure(self, limits: GrammarLimits) -> None:
        """Set the server's limits (before serving)."""
        self.limits = limits
        self.cache.max_bytes = limits.cache_bytes

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

    def check(self, params: StructuredOutputsParams) -> int:
        """The cheap checks before a compile (its size); returns the source's bytes."""
        return check_source_size(params, self.limits)

    def compile(self, params: StructuredOutputsParams, keep: Any = None) -> Any:
        """A compiled matcher for ``params`` (cached), also handed to the request as
        ``params.compiled``; ValueError naming the field when the schema, regex or
        grammar is invalid or over a limit. Safe to call from any thread. ``keep()``
        False (a compile past its time limit): the result is neither cached nor kept."""
        self.check(params)
        text = grammar_text(params)
        found = self.cache.get(text)
        if found is None:
            found = self._compile(params.kind, text)
            if (keep is None or keep()) and self.cache.put(text, found):
                malloc_trim()  # evicted grammars' heap back to the OS
        if keep is None or keep():
            params.compiled = found
        return found.matcher

    def _compile(self, kind: str, text: str) -> CompiledGrammar:
        llg = _import_llguidance()
        tok = self._tokenizer()
        limits = llg.LLParserLimits(verbose_errors=False,
                                    max_lexer_states=self.limits.max_lexer_states)
        matcher = llg.LLMatcher(tok, text, log_level=0, limits=limits)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{kind}: {clean_error(matcher.get_error())}")
        # One mask on a copy: a grammar that allows no first token (a rule defined only
        # by itself) would end its request with empty output.
        trial = matcher.deep_copy()
        mask = llg.numpy.allocate_token_bitmask(1, self.vocab_size)
        llg.numpy.fill_next_token_bitmask(trial, mask, 0)
        if trial.is_error() or (not mask.any() and not trial.is_accepting()):
            raise ValueError(f"structured_outputs.{kind}: the constraint allows no output "
                             "(a rule or $ref defined only by itself?)")
        return CompiledGrammar(matcher, estimated_bytes(text))

    async def compile_async(self, params: StructuredOutputsParams) -> None:
        """``compile`` on the grammar pool, within the time limit (engine/grammar_pool.py);
        ``params.compiled`` is set. For the server's event loop."""
        if self.pool is None:
            from iterserve.engine.grammar_pool import GrammarPool

            self.pool = GrammarPool(self)
        await self.pool.compile(params)

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()

    # -- per request (engine thread) --------------------------------------------------------

    def add_request(self, request_id: str, params: StructuredOutputsParams) -> None:
        # A compiled matcher is a template: each request walks its own copy. The server
        # compiled it already (it rides with the request); offline, compile it now.
        compiled = params.compiled
        template = compiled.matcher if compiled is not None else self.compile(params)
        self.matchers[request_id] = template.deep_copy()
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
