"""Tool calling: OpenAI's ``tools`` / ``tool_choice`` / ``parallel_tool_calls``.

- ``none``: the tools are shown to the chat template, no call is made.
- ``required`` and a named function: the output is constrained by the structured-output
  machinery (a JSON array of ``{"name", "parameters"}`` objects, or the named function's
  parameters), so the arguments always parse.
- ``auto`` (needs ``--enable-auto-tool-choice`` and ``--tool-call-parser``, as vLLM):
  the model writes what it likes; a parser for its family's format
  (``entrypoints/tool_parsers.py``: ``hermes``, ``llama3_json``, ``pythonic``,
  ``phi4_mini_json``) pulls the calls out of the text.

With a reasoning parser, the tools see only the content after the reasoning.
Streaming (``entrypoints/chat_stream.py``): content is sent as it comes until a call may
have begun; the calls are sent as ``tool_calls`` deltas in OpenAI's shape (a named
call's arguments as they are generated, the others whole once their text is complete).
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from typing import Any

from iterserve.core.sampling_params import StructuredOutputsParams
from iterserve.entrypoints.tool_parsers import TOOL_PARSERS, ToolCall, ToolParser, _call_from

__all__ = ["TOOL_PARSERS", "ToolCall", "ToolError", "ToolPlan", "plan_tools",
           "template_messages"]


class ToolError(ValueError):
    """A malformed tool field; ``param`` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


# -- a request's plan -------------------------------------------------------------------------


@dataclass(slots=True)
class ToolPlan:
    mode: str  # none | auto | required | named
    tools: list[dict[str, Any]]  # for the chat template
    name: str | None = None  # the named function
    parser: ToolParser | None = None  # auto's parser
    constraint: StructuredOutputsParams | None = None

    @property
    def is_streamed_as_arguments(self) -> bool:
        return self.mode == "named"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of one finished choice."""
        if self.mode == "named":
            return None, [ToolCall(str(self.name), text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except json.JSONDecodeError:
                return text, []  # cut short by max_tokens: no complete call
            calls = [_call_from(o) for o in items] if isinstance(items, list) else []
            return (None, [c for c in calls if c is not None]) if all(calls) else (text, [])
        if self.parser is not None:
            return self.parser.extract(text)
        return text, []

    def content_prefix(self, text: str) -> int:
        if self.parser is not None:
            return self.parser.content_prefix(text)
        return len(text) if self.mode == "none" else 0

    def finish_reason(self, reason: str | None, calls: list[ToolCall]) -> str | None:
        # OpenAI: a forced (named) call ends with "stop", a call the model chose or had
        # to make with "tool_calls".
        if calls and reason == "stop" and self.mode in ("auto", "required"):
            return "tool_calls"
        return reason


def _check_tools(tools: Any) -> dict[str, dict[str, Any]]:
    if not isinstance(tools, list) or not tools:
        raise ToolError("tools must be a non-empty list", "tools")
    by_name: dict[str, dict[str, Any]] = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise ToolError(f"tools.{i} must be {{'type': 'function', 'function': {{...}}}}", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise ToolError(f"tools.{i}.function.name must match [A-Za-z0-9_.-]{{1,64}}", "tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ToolError(f"tools.{i}.function.parameters must be a JSON schema object", "tools")
        by_name[name] = params
    return by_name


def plan_tools(
    tools: Any,
    tool_choice: Any,
    parallel_tool_calls: bool | None,
    *,
    enable_auto_tool_choice: bool,
    tool_call_parser: str | None,
    disable_any_whitespace: bool = False,
) -> ToolPlan | None:
    """The plan for a chat request, or None without tools; ToolError for bad input."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ToolError("tool_choice needs tools", "tool_choice")
        return None
    by_name = _check_tools(tools)
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan("none", tools)
    if choice == "auto":
        if not enable_auto_tool_choice or tool_call_parser is None:
            raise ToolError(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set", "tool_choice",
            )
        return ToolPlan("auto", tools, parser=TOOL_PARSERS.get(tool_call_parser)())
    if choice == "required":
        items = [
            {"type": "object",
             "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
             "required": ["name", "parameters"], "additionalProperties": False}
            for name, params in by_name.items()
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan("required", tools, constraint=StructuredOutputsParams(
            json=schema, disable_any_whitespace=disable_any_whitespace))
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise ToolError(
            "tool_choice must be none, auto, required or "
            "{'type': 'function', 'function': {'name': ...}}", "tool_choice",
        )
    if name not in by_name:
        raise ToolError(f"tool_choice names {name!r:.64}, which is not in tools", "tool_choice")
    return ToolPlan("named", tools, name=name, constraint=StructuredOutputsParams(
        json=by_name[name], disable_any_whitespace=disable_any_whitespace))


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant tool calls with their arguments as objects, as chat templates expect.
    Raises ToolError for a call whose ``function`` is not an object."""
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if calls:
            m = dict(m)
            fixed = []
            for c in calls:
                fn = c.get("function") or {}
                if not isinstance(fn, dict):
                    raise ToolError("a tool call's function must be an object",
                                    f"messages.{i}.tool_calls")
                fn = dict(fn)
                if isinstance(fn.get("arguments"), str):
                    with contextlib.suppress(json.JSONDecodeError):  # left as the client sent it
                        fn["arguments"] = json.loads(fn["arguments"])
                fixed.append({**c, "function": fn})
            m["tool_calls"] = fixed
        out.append(m)
    return out
