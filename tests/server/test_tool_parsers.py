"""Each family's tool-call format on strings: the finished text (``extract``) and the
same text streamed in pieces split at every position, through the chat stream's tool
deltas. Streaming must never send call text as content, and must end with the same
calls and content as the finished text."""

from __future__ import annotations

import json

import pytest

from iterserve.entrypoints.chat_stream import ChatDeltas
from iterserve.entrypoints.parser_registry import partial_marker
from iterserve.entrypoints.server_config import ServerConfig
from iterserve.entrypoints.tool_parsers import (
    TOOL_PARSERS,
    Phi4MiniJsonToolParser,
    PythonicToolParser,
)
from iterserve.entrypoints.tools import plan_tools

TOOLS = [{"type": "function", "function": {"name": n}} for n in ("get_weather", "get_time")]

# (parser, model text, expected content, expected [(name, arguments)])
CASES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "Paris"}}\n</tool_call>', "Let me check.",
     [("get_weather", {"city": "Paris"})]),
    ("hermes", "No call, just text.", "No call, just text.", []),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "get_time", "parameters": {"tz": "utc"}}', None,
     [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "utc"})]),
    ("llama3_json", '{"name": "get_time", "parameters": {}}', None, [("get_time", {})]),
    ("llama3_json", "Plain answer.", "Plain answer.", []),
    ("pythonic", '[get_weather(city="Paris", days=3, hourly=True), get_time(tz=None)]', None,
     [("get_weather", {"city": "Paris", "days": 3, "hourly": True}),
      ("get_time", {"tz": None})]),
    ("pythonic", '<|python_start|>[get_weather(city="Rome", at=[1, -2.5], '
     'opts={"unit": "c"})]<|python_end|>', None,
     [("get_weather", {"city": "Rome", "at": [1, -2.5], "opts": {"unit": "c"}})]),
    ("pythonic", "The answer is 4.", "The answer is 4.", []),
    ("phi4_mini_json", 'functools[{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
     '{"name": "get_time", "arguments": {"tz": "cet"}}]', None,
     [("get_weather", {"city": "Oslo"}), ("get_time", {"tz": "cet"})]),
    ("phi4_mini_json", 'Sure. functools[{"name": "get_time", "parameters": {"tz": "utc"}}]',
     "Sure.", [("get_time", {"tz": "utc"})]),
    ("phi4_mini_json", "import functools\nfunctools.reduce(f, xs)",
     "import functools\nfunctools.reduce(f, xs)", []),
]


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_extract(name, text, content, calls):
    got_content, got_calls = TOOL_PARSERS.get(name)().extract(text)
    assert got_content == content and _calls(got_calls) == calls


def _stream(name: str, pieces: list[str]) -> tuple[str, list, str | None]:
    plan = plan_tools(TOOLS, "auto", None, enable_auto_tool_choice=True, tool_call_parser=name)
    deltas = ChatDeltas(1, plan, None)
    content, calls, finish = "", [], None
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        delta, f = deltas.delta(0, piece, True, "stop" if last else None)
        content += delta.get("content") or ""
        calls += delta.get("tool_calls") or []
        if not last:
            assert "tool_calls" not in delta  # calls come whole, at the end
        finish = f or finish
    return content, calls, finish


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_streamed_at_every_split_gives_the_same_reply(name, text, content, calls):
    for cut in [*range(len(text) + 1), None]:
        pieces = list(text) if cut is None else [text[:cut], text[cut:]]
        got, got_calls, finish = _stream(name, pieces)
        if calls:
            assert got.strip() == (content or ""), (cut, got)
            assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                    for c in got_calls] == calls
            assert [c["index"] for c in got_calls] == list(range(len(calls)))
            assert finish == "tool_calls"
        else:
            assert got == text and not got_calls and finish == "stop"


@pytest.mark.parametrize("name, text, content, calls", [c for c in CASES if c[3]])
def test_no_call_text_is_sent_as_content_before_the_end(name, text, content, calls):
    plan = plan_tools(TOOLS, "auto", None, enable_auto_tool_choice=True, tool_call_parser=name)
    deltas = ChatDeltas(1, plan, None)
    sent = ""
    for ch in text:
        delta, _ = deltas.delta(0, ch, True, None)
        sent += delta.get("content") or ""
    assert sent.strip() == (content or "")  # all of it content, none of the call


@pytest.mark.parametrize("text", [
    '[f(a=__import__("os").system("true"))]',  # a call in an argument: not a literal
    "[f(1)]",  # positional
    "[f(**{'a': 1})]",
    "[os.system(a=1)]",  # an attribute callee
    "[f(a={1, 2})]",  # a set is not JSON
    "[f(a=b'x')]",
    "[f(a=1e999)]",  # infinity is not JSON
    "[f(a=1 + 2)]",
    "[f(a=x)]",
    "[]",
    "[f(a=1)",
    "[" * 500 + "]" * 500,  # deep nesting: a parser error, not a crash
])
def test_pythonic_takes_literals_only(text):
    assert PythonicToolParser().extract(text) == (text, [])


def test_phi4_needs_a_list_after_functools():
    p = Phi4MiniJsonToolParser()
    for text in ['functools[{"name": "f"', 'functools{"name": "f"}', "functools[1, 2]",
                 'functools[{"arguments": {}}]']:
        assert p.extract(text) == (text, [])
    assert p.content_prefix("use functools.partial") == len("use functools.partial")
    assert p.content_prefix("Sure. functools") == len("Sure. ")
    assert p.content_prefix("Sure. funct") == len("Sure. ")


def test_partial_marker():
    assert partial_marker("abc <too", "<tool_call>") == 4
    assert partial_marker("abc", "<tool_call>") == 0
    assert partial_marker("<tool_call>", "<tool_call>") == 0  # whole: not partial


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="hermes, llama3_json, phi4_mini_json, pythonic"):
        ServerConfig(tool_call_parser="nope")
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        ServerConfig(reasoning_parser="nope")
