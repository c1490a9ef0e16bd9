"""--reasoning-parser through the official openai client against a real server.

The checkpoint's tokenizer has ``<think>`` and ``</think>`` as single tokens (as Qwen3's
and DeepSeek-R1's have). The random model writes neither by itself: a logit bias on
``</think>`` makes it end its (random) reasoning after a few tokens, and a regex (or a
tool call's grammar), which waits for the end of the reasoning, decides the content.
So the reasoning is whatever the model sampled, the content is exactly the constraint's
language, and both are split by the parser, not by the grammar."""

from __future__ import annotations

import json

import openai
import pytest
from tokenizers import AddedToken, Tokenizer

from iterserve.model.default_model import build_tokenizer
from tests.model.helpers import make_checkpoint
from tests.server.helpers import MODEL, ServerThread

# Newer Qwen3 templates open the think block in the prompt; enable_thinking: false
# closes it there.
THINKING_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\n\n</think>\n\n' }}{% else %}{{ '<think>\n' }}{% endif %}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "What time is it?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "tz": {"enum": ["utc", "cet"]}}, "required": ["tz"], "additionalProperties": False}}}]
SEEDS = range(12)


@pytest.fixture(scope="module")
def think_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("think-llama")
    vocab, _ = build_tokenizer(path)
    make_checkpoint(path, "llama", vocab_size=vocab + 2)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_tokens([AddedToken("<think>", special=False, normalized=False),
                    AddedToken("</think>", special=False, normalized=False)])
    tok.save(str(path / "tokenizer.json"))
    assert tok.token_to_id("</think>") == vocab + 1
    return path, vocab + 1


def _client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)


def _ask(c, end_id, seed, **kw):
    body = dict(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=1.0, seed=seed,
                logit_bias={str(end_id): 3.0})
    extra = kw.pop("extra_body", {})
    return c.chat.completions.create(**{**body, **kw},
                                     extra_body={"return_token_ids": True, **extra})


def _stream(c, end_id, seed, **kw):
    """(reasoning, content, tool calls by index, finish) from the deltas, checking the
    reasoning comes first and no marker is ever sent."""
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in _ask(c, end_id, seed, stream=True, **kw):
        for ch in chunk.choices:
            d = ch.delta
            r = getattr(d, "reasoning", None)
            assert r == getattr(d, "reasoning_content", None)
            if r:
                assert not content and not calls  # reasoning before the answer
                reasoning += r
            content += d.content or ""
            for tc in d.tool_calls or []:
                entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                entry["name"] += (tc.function.name or "") if tc.function else ""
                entry["arguments"] += (tc.function.arguments or "") if tc.function else ""
            finish = ch.finish_reason or finish
    assert "</think>" not in content and "</think>" not in reasoning
    return reasoning, content, calls, finish


def _ended_reasoning(r, end_id) -> bool:
    return end_id in (r.choices[0].token_ids or [])


def test_qwen3_with_the_think_block_opened_by_the_prompt(think_model):
    path, end_id = think_model
    regex = {"structured_outputs": {"regex": r"Sure\."}}
    with ServerThread(path, reasoning_parser="qwen3", chat_template=THINKING_TEMPLATE) as s, \
            _client(s) as c:
        thought_out = 0
        for seed in SEEDS:
            r = _ask(c, end_id, seed, extra_body=regex)
            msg = r.choices[0].message
            assert msg.reasoning == msg.reasoning_content
            if _ended_reasoning(r, end_id):
                assert msg.content == "Sure."  # the regex held after </think> only
                assert r.choices[0].finish_reason == "stop"
                thought_out += bool(msg.reasoning)
                assert "</think>" not in (msg.reasoning or "")
                streamed = _stream(c, end_id, seed, extra_body=regex)
                assert streamed[:2] == (msg.reasoning or "", "Sure.")
            else:  # cut short while thinking: all reasoning
                assert msg.content is None and msg.reasoning
                assert r.choices[0].finish_reason == "length"
        assert thought_out  # some seed reasoned (freely: no grammar) before its answer

        # enable_thinking: false closes the block in the prompt: the output is content,
        # and the regex applies from the first token.
        for seed in SEEDS[:3]:
            r = _ask(c, end_id, seed, extra_body={
                **regex, "chat_template_kwargs": {"enable_thinking": False}})
            msg = r.choices[0].message
            assert (msg.content, msg.reasoning) == ("Sure.", None)

        # include_reasoning: false leaves it out.
        r = _ask(c, end_id, 0, extra_body={**regex, "include_reasoning": False})
        assert r.choices[0].message.reasoning is None


def _answered(c, end_id, **kw):
    """Seeds whose reasoning ended (and was not empty), with their replies."""
    out = []
    for seed in SEEDS:
        r = _ask(c, end_id, seed, **kw)
        if _ended_reasoning(r, end_id) and r.choices[0].message.reasoning:
            out.append((seed, r))
    assert out, "no seed ended its reasoning"
    return out


def test_deepseek_r1_then_an_auto_tool_call(think_model):
    # The default template leaves <think> to the model; deepseek_r1 reads reasoning
    # until </think> all the same. The hermes parser sees only what follows.
    path, end_id = think_model
    call_re = (r'Sure\. <tool_call>\{"name":"get_time","arguments":\{"tz":"(utc|cet)"\}\}'
               r"</tool_call>")
    kw = dict(tools=TOOLS, max_tokens=200,
              extra_body={"structured_outputs": {"regex": call_re}})
    with ServerThread(path, reasoning_parser="deepseek_r1", enable_auto_tool_choice=True,
                      tool_call_parser="hermes") as s, _client(s) as c:
        answered = _answered(c, end_id, **kw)
        for seed, r in answered:
            choice = r.choices[0]
            assert choice.finish_reason != "length", choice
            assert choice.message.content == "Sure."
            assert [t.function.name for t in choice.message.tool_calls] == ["get_time"]
            assert choice.finish_reason == "tool_calls"
            reasoning, content, calls, finish = _stream(c, end_id, seed, **kw)
            assert reasoning == choice.message.reasoning
            assert content.strip() == "Sure." and finish == "tool_calls"
            assert calls[0]["name"] == "get_time"
            assert json.loads(calls[0]["arguments"])["tz"] in ("utc", "cet")


def test_a_required_tool_call_after_the_reasoning(think_model):
    path, end_id = think_model
    kw = dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
              extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    with ServerThread(path, reasoning_parser="deepseek_r1") as s, _client(s) as c:
        answered = _answered(c, end_id, **kw, max_tokens=200)
        for _, r in answered:
            choice = r.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            assert json.loads(choice.message.tool_calls[0].function.arguments)["tz"] in (
                "utc", "cet")
