"""Tool-call parsers for ``tool_choice: "auto"`` (``--tool-call-parser NAME``, vLLM's
names): each pulls the calls out of one model family's text.

| name | format | models |
|---|---|---|
| ``hermes`` | ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` | Qwen2.5 / Qwen3, Hermes |
| ``llama3_json`` | ``{"name": ..., "parameters": {...}}``, several joined by ``;``, optionally after ``<|python_tag|>`` | Llama 3.1 / 3.2 / 3.3 |
| ``pythonic`` | ``[get_weather(city="Paris"), get_time(tz="utc")]`` (optionally inside ``<|python_start|>`` ... ``<|python_end|>``) | Llama 3.2 / Llama 4 |
| ``phi4_mini_json`` | ``functools[{"name": ..., "arguments": {...}}, ...]`` | Phi-4-mini |

A parser has two methods: ``extract(text) -> (content, calls)`` for a finished text
(text that is not a well-formed call stays content), and ``content_prefix(text)``: how
much of a growing text is content for certain, i.e. no call can begin in it (streaming
sends that much as content and holds the rest). ``pythonic`` reads its calls with
``ast``: literal arguments only (strings, numbers, booleans, None, lists, dicts), nothing
is evaluated.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from iterserve.entrypoints.parser_registry import ParserRegistry, partial_marker


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")

    def to_dict(self, index: int | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {
            "id": self.id, "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            d["index"] = index
        return d


class ToolParser(Protocol):
    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]: ...

    def content_prefix(self, text: str) -> int: ...


TOOL_PARSERS: ParserRegistry[ToolParser] = ParserRegistry("tool call parser",
                                                          "--tool-call-parser")


def _call_from(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))


def _may_open(body: str, *openers: str) -> bool:
    """Whether ``body`` (stripped of leading space) starts, or may yet start, with one
    of ``openers``."""
    return not body or any(body.startswith(o) or o.startswith(body) for o in openers)


@TOOL_PARSERS.register("hermes")
class HermesToolParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen, Hermes)."""

    START, END = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find(self.START)
        if start < 0:
            return text, []
        calls = []
        for m in self._CALL.finditer(text, start):
            try:
                call = _call_from(json.loads(m.group(1)))
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []  # not a well-formed call: leave the text as content
            calls.append(call)
        content = text[:start].strip()
        return content or None, calls

    def content_prefix(self, text: str) -> int:
        start = text.find(self.START)
        return start if start >= 0 else len(text) - partial_marker(text, self.START)


@TOOL_PARSERS.register("llama3_json")
class Llama3JsonToolParser:
    """Llama 3.x JSON calls: ``{"name": ..., "parameters": {...}}``, several joined by
    ``;``, optionally after ``<|python_tag|>``; text that starts otherwise is content."""

    TAG = "<|python_tag|>"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG):].lstrip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, pos = json.JSONDecoder(), [], 0
        try:
            while pos < len(body):
                obj, pos = decoder.raw_decode(body, pos)
                call = _call_from(obj)
                if call is None:
                    return text, []
                calls.append(call)
                rest = body[pos:].lstrip()
                if rest.startswith(";"):
                    rest = rest[1:].lstrip()
                elif rest:
                    return text, []
                pos = len(body) - len(rest)
        except json.JSONDecodeError:
            return text, []
        return None, calls

    def content_prefix(self, text: str) -> int:
        return 0 if _may_open(text.lstrip(), "{", self.TAG) else len(text)


@TOOL_PARSERS.register("phi4_mini_json")
class Phi4MiniJsonToolParser:
    """Phi-4-mini: ``functools[{"name": ..., "arguments": {...}}, ...]``; the text
    around the list is content."""

    START = "functools"

    def _opening(self, text: str) -> tuple[int, int] | None:
        """(where ``functools`` starts, where its ``[`` is) for the first one followed
        by a ``[``; (start, -1) when the text ends before that is decided."""
        pos = 0
        while (i := text.find(self.START, pos)) >= 0:
            j = i + len(self.START)
            rest = text[j:].lstrip()
            if not rest:
                return i, -1
            if rest.startswith("["):
                return i, len(text) - len(rest)
            pos = j
        return None

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        found = self._opening(text)
        if found is None or found[1] < 0:
            return text, []
        start, bracket = found
        try:
            items, end = json.JSONDecoder().raw_decode(text, bracket)
        except json.JSONDecodeError:
            return text, []
        calls = [_call_from(o) for o in items] if isinstance(items, list) else []
        if not calls or not all(calls):
            return text, []
        content = " ".join(p for p in (text[:start].strip(), text[end:].strip()) if p)
        return content or None, [c for c in calls if c is not None]

    def content_prefix(self, text: str) -> int:
        found = self._opening(text)
        return found[0] if found is not None else len(text) - partial_marker(text, self.START)


@TOOL_PARSERS.register("pythonic")
class PythonicToolParser:
    """A Python list of calls with keyword arguments, ``[f(a=1), g(b="x")]`` (Llama 3.2,
    Llama 4 inside ``<|python_start|>`` ... ``<|python_end|>``); read with ``ast``,
    literals only."""

    START, END = "<|python_start|>", "<|python_end|>"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        if body.startswith(self.START):
            body = body[len(self.START):].strip()
            if body.endswith(self.END):
                body = body[: -len(self.END)].rstrip()
        if not (body.startswith("[") and body.endswith("]")):
            return text, []
        try:
            tree = ast.parse(body, mode="eval")
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return text, []
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return text, []
        calls = []
        for node in tree.body.elts:
            call = _pythonic_call(node)
            if call is None:
                return text, []
            calls.append(call)
        return None, calls

    def content_prefix(self, text: str) -> int:
        return 0 if _may_open(text.lstrip(), "[", self.START) else len(text)


def _pythonic_call(node: ast.expr) -> ToolCall | None:
    """``name(k=literal, ...)`` as a call; anything else (positional or ``**`` arguments,
    an attribute or computed callee, a non-literal or non-JSON value) is None."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    args: dict[str, Any] = {}
    for kw in node.keywords:
        if kw.arg is None:
            return None
        try:
            args[kw.arg] = ast.literal_eval(kw.value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
    try:
        arguments = json.dumps(args, allow_nan=False)  # sets, bytes, complex: not JSON
    except (TypeError, ValueError):
        return None
    return ToolCall(node.func.id, arguments)
