"""The budget of a structured-output request: what is checked before a grammar is
compiled, and how a compiler's error reaches the client.

- ``GrammarLimits``: the source size cap, the compile time limit, the compile pool's
  threads, the cache's bytes, the compiled lexer's state cap (docs/security.md).
- ``check_source_size``: a JSON schema, regex, grammar or choice list over the cap is
  refused before any work that grows with it (a dict schema is measured by a walk
  that stops at the cap, so an 8 MiB schema costs no more than one at the cap).
- ``find_ref_loop``: a schema whose ``$ref`` chain comes back to itself without
  consuming input defines nothing (llguidance compiles it, and the request would end
  with empty output); it is refused naming the loop.
- ``clean_error``: a compiler message cut to its first lines; a library panic (Rust's
  text and backtrace) never reaches a client.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from iterserve.core.sampling_params import StructuredOutputsParams

# Grammars whose source is at most this many bytes compile on a thread of their own,
# so a flood of huge ones never queues them.
SMALL_GRAMMAR_BYTES = 4096
# A compiled grammar's memory, estimated from its llguidance text (measured: 45-110
# bytes of heap per byte for choice lists, JSON schemas and regexes, more for tiny ones).
_BYTES_PER_GRAMMAR_BYTE = 128
_GRAMMAR_BASE_BYTES = 64 * 1024
_MAX_ERROR_CHARS = 400


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    """Per-request grammar budget; each is a server flag (docs/security.md)."""

    # Bytes of a request's schema (as JSON), regex, grammar or choice list (summed).
    max_source_bytes: int = 128 * 1024
    # Seconds from a request's compile being queued to its grammar being ready; past
    # it the request is a 400 and its compile's result is dropped (not cached).
    compile_timeout_s: float = 10.0
    # Threads compiling grammars over SMALL_GRAMMAR_BYTES (small ones have one more).
    compile_threads: int = 1
    # Estimated bytes of compiled grammars kept for reuse (least recently used go).
    cache_bytes: int = 32 * 1024 * 1024
    # llguidance's cap on the lexer's states (each 1-2 kB), built as requests decode.
    max_lexer_states: int = 50_000

    def __post_init__(self) -> None:
        for name in ("max_source_bytes", "compile_threads", "max_lexer_states"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.compile_timeout_s > 0:
            raise ValueError(f"compile_timeout_s must be > 0, got {self.compile_timeout_s}")
        if self.cache_bytes < 0:
            raise ValueError(f"cache_bytes must be >= 0, got {self.cache_bytes}")


class GrammarLimitError(ValueError):
    """A constraint over a limit; its message names the field and the limit."""


def source_size(params: StructuredOutputsParams, limit: int) -> int:
    """The constraint's size in bytes, counted up to just past ``limit``."""
    kind = params.kind
    if kind == "json_object":
        return 0
    if kind == "json":
        schema = params.json
        if isinstance(schema, str):
            return len(schema.encode("utf-8", "surrogatepass"))
        return _json_size(schema, limit)
    if kind == "choice":
        total = 0
        for c in params.choice or []:
            total += len(c.encode("utf-8", "surrogatepass")) + 3  # quotes and a separator
            if total > limit:
                break
        return total
    text = params.regex if kind == "regex" else params.grammar
    return len((text or "").encode("utf-8", "surrogatepass"))


def _json_size(value: Any, limit: int) -> int:
    """Bytes of ``value`` as compact JSON, or a number past ``limit`` once it is clear
    the value is larger (the walk stops there)."""
    total = 0
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            total += 2 + 2 * len(v)
            for k, item in v.items():
                total += len(str(k)) + 2
                stack.append(item)
        elif isinstance(v, list):
            total += 2 + len(v)
            stack.extend(v)
        elif isinstance(v, str):
            total += len(v) + 2
        else:
            total += len(json.dumps(v))
        if total > limit:
            return total
    return total


def check_source_size(params: StructuredOutputsParams, limits: GrammarLimits) -> int:
    """The constraint's size; GrammarLimitError when it is over the cap."""
    size = source_size(params, limits.max_source_bytes)
    if size > limits.max_source_bytes:
        raise GrammarLimitError(
            f"structured_outputs.{params.kind} is too large: over {limits.max_source_bytes} "
            f"bytes (the server's --max-structured-output-bytes)")
    return size


def find_ref_loop(schema: Any) -> list[str] | None:
    """A chain of local ``$ref`` s that returns to where it started without consuming
    input (each link the whole schema or an ``allOf`` member), as the pointers walked;
    None when there is none. Only local references (``#`` and ``#/...``) are followed."""
    if not isinstance(schema, dict):
        return None
    nodes: dict[str, Any] = {}
    _index(schema, "#", nodes)

    def links(ptr: str) -> list[str]:
        node = nodes.get(ptr)
        out: list[str] = []
        todo = [node]
        while todo:
            n = todo.pop()
            if not isinstance(n, dict):
                continue
            ref = n.get("$ref")
            if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
                out.append(ref.rstrip("/") or "#")
            members = n.get("allOf")
            if isinstance(members, list):
                todo.extend(members)
        return out

    state: dict[str, int] = {}  # 1: on the path, 2: done
    for start in nodes:
        if state.get(start):
            continue
        path = [start]
        its = [iter(links(start))]
        state[start] = 1
        while its:
            nxt = next(its[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                its.pop()
                continue
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt in nodes and not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                its.append(iter(links(nxt)))
    return None


def _index(node: Any, ptr: str, nodes: dict[str, Any], depth: int = 0) -> None:
    """Every sub-schema's JSON pointer (bounded depth: the source is size-capped)."""
    if depth > 64 or len(nodes) > 100_000:
        return
    if isinstance(node, dict):
        nodes[ptr] = node
        for k, v in node.items():
            key = str(k).replace("~", "~0").replace("/", "~1")
            _index(v, f"{ptr}/{key}", nodes, depth + 1)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _index(v, f"{ptr}/{i}", nodes, depth + 1)


def clean_error(message: str) -> str:
    """A compiler's message fit for a client: a library panic becomes a plain sentence,
    anything else is cut to its first lines."""
    text = str(message or "").strip()
    lowered = text.lower()
    if "panicked" in lowered or "backtrace" in lowered or "panic" in lowered:
        return "the grammar could not be compiled (the compiler failed on it)"
    if len(text) > _MAX_ERROR_CHARS:
        text = text[:_MAX_ERROR_CHARS].rstrip() + " ..."
    return text or "the grammar could not be compiled"


def estimated_bytes(grammar_text: str) -> int:
    """A compiled grammar's memory, estimated from its llguidance text."""
    return _GRAMMAR_BASE_BYTES + _BYTES_PER_GRAMMAR_BYTE * len(grammar_text)
