"""Reasoning parsers on strings: qwen3's and deepseek_r1's reading of a finished output
for each place the prompt may leave the model, and the same output streamed in pieces
split at every position (a marker split across deltas is held, never leaked), alone and
in front of a tool call."""

from __future__ import annotations

import json

import pytest

from iterserve.entrypoints.chat_stream import ChatDeltas, ChatReasoning, reply
from iterserve.entrypoints.reasoning import REASONING_PARSERS
from iterserve.entrypoints.tools import plan_tools

# (parser, prompt state, output, expected (reasoning, content))
CASES = [
    ("qwen3", "none", "<think>\nplan it\n</think>\n\nThe answer.",
     ("\nplan it\n", "\n\nThe answer.")),
    ("qwen3", "none", "The answer, no thinking.", (None, "The answer, no thinking.")),
    ("qwen3", "none", "a</think>b", (None, "a</think>b")),  # no <think>: all content
    ("qwen3", "none", "<think>cut short", ("cut short", None)),
    ("qwen3", "none", "  <think>x</think>y", ("x", "y")),
    ("qwen3", "none", "<thinking>", (None, "<thinking>")),
    ("qwen3", "open", "thoughts</think>answer", ("thoughts", "answer")),  # <think> in prompt
    ("qwen3", "open", "still thinking", ("still thinking", None)),
    ("qwen3", "closed", "\n\nanswer", (None, "\n\nanswer")),  # enable_thinking: false
    ("qwen3", "closed", "<think>again</think>answer", ("again", "answer")),
    ("deepseek_r1", "none", "thoughts</think>answer", ("thoughts", "answer")),
    ("deepseek_r1", "none", "<think>thoughts</think>answer", ("thoughts", "answer")),
    ("deepseek_r1", "none", "no end marker", ("no end marker", None)),
    ("deepseek_r1", "none", "</think>", (None, None)),
    ("deepseek_r1", "open", "t</think>a</think>b", ("t", "a</think>b")),
    ("deepseek_r1", "closed", "answer", (None, "answer")),
    ("qwen3", "none", "", (None, None)),
    ("deepseek_r1", "none", "<", ("<", None)),
    ("qwen3", "none", "<", (None, "<")),
    ("deepseek_r1", "none", "abc</thi", ("abc</thi", None)),
]


@pytest.mark.parametrize("name, state, text, expected", CASES)
def test_extract(name, state, text, expected):
    assert REASONING_PARSERS.get(name)().extract(text, state) == expected


def _stream(name, state, pieces, plan=None):
    deltas = ChatDeltas(1, plan, ChatReasoning(REASONING_PARSERS.get(name)(), state))
    out = {"reasoning": "", "content": "", "tool_calls": []}
    seen_content = False
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        delta, _ = deltas.delta(0, piece, True, "stop" if last else None)
        assert delta.get("reasoning") == delta.get("reasoning_content")  # both names
        if delta.get("reasoning"):
            assert not seen_content  # the reasoning comes first
        seen_content = seen_content or bool(delta.get("content"))
        out["reasoning"] += delta.get("reasoning") or ""
        out["content"] += delta.get("content") or ""
        out["tool_calls"] += delta.get("tool_calls") or []
    return out


@pytest.mark.parametrize("name, state, text, expected", CASES)
def test_streamed_at_every_split_gives_the_same_split(name, state, text, expected):
    reasoning, content = expected
    splits = [[text[:a], text[a:b], text[b:]] for a in range(len(text) + 1)
              for b in range(a, len(text) + 1)]
    for pieces in [*splits, list(text)]:
        out = _stream(name, state, pieces)
        assert (out["reasoning"], out["content"]) == (reasoning or "", content or ""), pieces


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_no_partial_marker_is_sent_while_streaming(name):
    text = "<think>step one</think>done"
    deltas = ChatDeltas(1, None, ChatReasoning(REASONING_PARSERS.get(name)(), "none"))
    for ch in text[:-4]:
        delta, _ = deltas.delta(0, ch, True, None)
        for part in (delta.get("reasoning") or "", delta.get("content") or ""):
            assert "<" not in part and ">" not in part, delta


def test_include_reasoning_false_leaves_it_out():
    r = ChatReasoning(REASONING_PARSERS.get("deepseek_r1")(), "none", include=False)
    assert reply("secret</think>answer", None, r) == (None, "answer", [])
    delta, _ = ChatDeltas(1, None, r).delta(0, "secret</think>answer", True, "stop")
    assert delta == {"content": "answer"}


def test_prompt_state_is_the_last_marker_in_the_prompt():
    p = REASONING_PARSERS.get("qwen3")()
    assert p.prompt_state("<|im_start|>assistant\n") == "none"
    assert p.prompt_state("<|im_start|>assistant\n<think>\n") == "open"
    assert p.prompt_state("<think>\n\n</think>\n\n") == "closed"
    assert p.prompt_state("<think>a</think> ... <think>\n") == "open"
    assert [p.grammar_waits(s) for s in ("none", "open", "closed")] == [True, True, False]


TOOLS = [{"type": "function", "function": {"name": "get_time"}}]
CALL = '<tool_call>{"name": "get_time", "arguments": {"tz": "utc"}}</tool_call>'


@pytest.mark.parametrize("name, state", [("qwen3", "none"), ("deepseek_r1", "none"),
                                         ("qwen3", "open")])
def test_tools_see_only_the_content(name, state):
    head = "" if state == "open" else "<think>"
    # A call written inside the reasoning is reasoning, not a call.
    text = f"{head}maybe {CALL}?</think>Sure. {CALL}"
    plan = plan_tools(TOOLS, "auto", None, enable_auto_tool_choice=True,
                      tool_call_parser="hermes")
    r = ChatReasoning(REASONING_PARSERS.get(name)(), state)
    thought, content, calls = reply(text, plan, r)
    assert thought == f"maybe {CALL}?" and content == "Sure."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"tz": "utc"})]
    for cut in range(len(text) + 1):
        out = _stream(name, state, [text[:cut], text[cut:]], plan)
        assert out["reasoning"] == thought and out["content"].strip() == "Sure.", cut
        assert [c["function"]["name"] for c in out["tool_calls"]] == ["get_time"]


def test_a_named_call_cut_short_in_its_reasoning_is_no_call():
    plan = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}}, None,
                      enable_auto_tool_choice=False, tool_call_parser=None)
    r = ChatReasoning(REASONING_PARSERS.get("deepseek_r1")(), "none")
    assert reply("still thinking", plan, r) == ("still thinking", None, [])
    out = _stream("deepseek_r1", "none", ["still ", "thinking"], plan)
    assert out == {"reasoning": "still thinking", "content": "", "tool_calls": []}
    out = _stream("deepseek_r1", "none", ["t</think>", '{"tz": ', '"utc"}'], plan)
    assert out["reasoning"] == "t" and out["tool_calls"][0]["function"]["name"] == "get_time"
    assert "".join(c["function"]["arguments"] for c in out["tool_calls"]) == '{"tz": "utc"}'
