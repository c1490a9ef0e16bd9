"""Tool calling through the official openai client: required and named choices enforced by
the grammar (arguments always parse), auto with each family's parser (hermes,
llama3_json, pythonic, phi4_mini_json), streaming deltas in OpenAI's shape, a tool-call
round trip, and the 400s."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from iterserve.engine.chat_template import DEFAULT_CHAT_TEMPLATE, render_chat
from iterserve.entrypoints.tool_parsers import HermesToolParser, Llama3JsonToolParser
from tests.server.helpers import MODEL, ServerThread

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6},
                   "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"tz": {"enum": ["utc", "cet"]}},
        "required": ["tz"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_WS = {"structured_outputs": {"disable_any_whitespace": True}}


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def _check_calls(calls, expect_name=None):
    assert calls
    for c in calls:
        assert c.type == "function" and c.id
        assert c.function.name in SCHEMAS
        if expect_name:
            assert c.function.name == expect_name
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


@pytest.mark.parametrize("parallel", [None, False])
def test_required_always_calls_a_tool_with_valid_arguments(client, parallel):
    kw = {} if parallel is None else {"parallel_tool_calls": parallel}
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
            max_tokens=200, temperature=1.0, seed=seed, extra_body=NO_WS, **kw,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        _check_calls(choice.message.tool_calls)
        assert choice.message.content is None
        if parallel is False:
            assert len(choice.message.tool_calls) == 1


def test_named_choice_calls_that_function(client):
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=64, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, extra_body=NO_WS,
    )
    choice = r.choices[0]
    _check_calls(choice.message.tool_calls, "get_weather")
    assert choice.finish_reason == "stop"  # OpenAI ends a forced call with stop


@pytest.mark.parametrize("tool_choice", ["required",
                                         {"type": "function", "function": {"name": "get_time"}}])
def test_streamed_tool_call_deltas_rebuild_the_calls(client, tool_choice):
    calls: dict[int, dict] = {}
    finish = None
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=200,
        temperature=0.7, seed=5, stream=True, extra_body=NO_WS,
    )
    for chunk in stream:
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                if tc.id:
                    assert entry["id"] is None  # the id comes once, in the first delta
                    entry["id"] = tc.id
                if tc.function and tc.function.name:
                    entry["name"] += tc.function.name
                if tc.function and tc.function.arguments:
                    entry["arguments"] += tc.function.arguments
            finish = ch.finish_reason or finish
    assert calls and finish in ("tool_calls", "stop")
    for c in calls.values():
        assert c["id"] and c["name"] in SCHEMAS
        jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])


def test_tool_call_round_trip(client):
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=64, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, extra_body=NO_WS,
    )
    call = r.choices[0].message.tool_calls[0]
    follow_up = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    r2 = client.chat.completions.create(model=MODEL, messages=follow_up, tools=TOOLS,
                                        tool_choice="none", max_tokens=8, temperature=0)
    assert r2.choices[0].message.content is not None
    assert not r2.choices[0].message.tool_calls


def test_auto_with_the_hermes_parser(model_path):
    # The random model never writes a call by itself: a regex makes it write one in the
    # hermes format, so the parser (not the grammar) has to find it.
    call_re = (r'Sure\. <tool_call>\{"name":"get_time","arguments":\{"tz":"(utc|cet)"\}\}'
               r"</tool_call>")
    with ServerThread(model_path, enable_auto_tool_choice=True,
                      tool_call_parser="hermes") as s, \
            openai.OpenAI(base_url=s.base_url + "/v1", api_key="x", max_retries=0) as c:
        body = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=64, temperature=0,
                    extra_body={"structured_outputs": {"regex": call_re}})
        r = c.chat.completions.create(**body)
        choice = r.choices[0]
        assert choice.message.content == "Sure."
        _check_calls(choice.message.tool_calls, "get_time")
        assert choice.finish_reason == "tool_calls"

        content, calls, finish = "", {}, None
        for chunk in c.chat.completions.create(stream=True, **body):
            for ch in chunk.choices:
                content += ch.delta.content or ""
                assert "<tool_call>" not in content  # held back, never sent as content
                for tc in ch.delta.tool_calls or []:
                    calls[tc.index] = tc
                finish = ch.finish_reason or finish
        assert content.strip() == "Sure." and finish == "tool_calls"
        assert calls[0].function.name == "get_time"
        # Without a call in the text, auto answers with content.
        r = c.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                      max_tokens=8, temperature=0)
        assert r.choices[0].message.content and not r.choices[0].message.tool_calls


# Each family's format, forced by a regex (the random model writes none by itself).
FAMILY_FORMATS = {
    "llama3_json": r'<\|python_tag\|>\{"name":"get_time","parameters":\{"tz":"(utc|cet)"\}\}',
    "pythonic": r'\[get_time\(tz="(utc|cet)"\), get_weather\(city="Oslo", unit="c"\)\]',
    "phi4_mini_json": r'functools\[\{"name":"get_time","arguments":\{"tz":"(utc|cet)"\}\}\]',
}


@pytest.mark.parametrize("parser", sorted(FAMILY_FORMATS))
def test_auto_with_each_familys_parser(model_path, parser):
    body = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=96, temperature=0,
                extra_body={"structured_outputs": {"regex": FAMILY_FORMATS[parser]}})
    with ServerThread(model_path, enable_auto_tool_choice=True, tool_call_parser=parser) as s, \
            openai.OpenAI(base_url=s.base_url + "/v1", api_key="x", max_retries=0) as c:
        choice = c.chat.completions.create(**body).choices[0]
        assert choice.message.content is None and choice.finish_reason == "tool_calls"
        _check_calls(choice.message.tool_calls)
        names = [t.function.name for t in choice.message.tool_calls]
        assert names == (["get_time", "get_weather"] if parser == "pythonic" else ["get_time"])

        content, calls, finish = "", {}, None
        for chunk in c.chat.completions.create(stream=True, **body):
            for ch in chunk.choices:
                content += ch.delta.content or ""
                for tc in ch.delta.tool_calls or []:
                    calls[tc.index] = tc
                finish = ch.finish_reason or finish
        assert content == "" and finish == "tool_calls"  # the call text never as content
        assert [calls[i].function.name for i in sorted(calls)] == names
        assert [calls[i].function.arguments for i in sorted(calls)] == [
            t.function.arguments for t in choice.message.tool_calls]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": TOOLS}, "tool_choice"),  # auto without --enable-auto-tool-choice
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}],
          "tool_choice": "required"}, "tools"),
        ({"tools": TOOLS, "tool_choice": "required",
          "response_format": {"type": "json_object"}}, "tool_choice"),
        # A past assistant turn whose tool call's function is not an object.
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": [["a", 1]]}]},
                       {"role": "user", "content": "hi"}]}, "messages.0.tool_calls"),
    ],
)
def test_bad_tool_requests_are_400s(server, body, param):
    r = httpx.post(server.base_url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_parsers():
    h = HermesToolParser()
    text = 'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>' \
           '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    content, calls = h.extract(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1}), ("g", {})]
    assert h.extract("no calls here") == ("no calls here", [])
    assert h.extract("<tool_call>{broken</tool_call>")[1] == []
    assert h.content_prefix("abc <tool") == 4 and h.content_prefix("abc") == 3
    assert h.content_prefix("x <tool_call>{") == 2

    ll = Llama3JsonToolParser()
    content, calls = ll.extract('<|python_tag|>{"name": "f", "parameters": {"a": 1}}; '
                                '{"name": "g", "parameters": {"b": "x"}}')
    assert content is None and [c.name for c in calls] == ["f", "g"]
    assert json.loads(calls[1].arguments) == {"b": "x"}
    assert ll.extract("Hello there") == ("Hello there", [])
    assert ll.extract('{"name": "f", "parameters": {}} trailing')[1] == []
    assert ll.content_prefix("Hello") == 5 and ll.content_prefix(' {"na') == 0
    assert ll.content_prefix("<|pyt") == 0


def test_default_template_renders_tools_and_tool_turns(model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    msgs = [*MESSAGES,
            {"role": "assistant", "content": "",
             "tool_calls": [{"id": "1", "type": "function",
                             "function": {"name": "get_time", "arguments": {"tz": "utc"}}}]},
            {"role": "tool", "tool_call_id": "1", "content": "12:00"}]
    text = render_chat(tok, msgs, chat_template=DEFAULT_CHAT_TEMPLATE, tools=TOOLS)
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "get_time", "arguments": {"tz": "utc"}}\n</tool_call>' in text
    assert "<tool_response>\n12:00\n</tool_response>" in text
