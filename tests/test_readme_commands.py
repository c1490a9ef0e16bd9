"""The README's commands as written, on the built-in default model: ``iterserve serve``
answered through the official ``openai`` client, ``iterserve generate``, and a GBNF
grammar. Whatever the default model is, the checks hold: text and a finish reason come
back (not a particular text), and a grammar's output is in its language."""

from __future__ import annotations

import json

import openai
import pytest

from iterserve.entrypoints.cli import main


@pytest.fixture(scope="module")
def client(readme_server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=readme_server + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    (card,) = client.models.list().data
    return card.id


def test_served_default_model_answers_a_completion(client: openai.OpenAI, model: str) -> None:
    out = client.completions.create(model=model, prompt="Hello, my name is", max_tokens=8,
                                    temperature=0, extra_body={"ignore_eos": True})
    (choice,) = out.choices
    assert isinstance(choice.text, str) and choice.text
    assert choice.finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 8


def test_served_default_model_answers_a_chat_and_streams(client: openai.OpenAI,
                                                         model: str) -> None:
    out = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is a KV cache?"}],
        max_tokens=8, temperature=0)
    (choice,) = out.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    chunks = list(client.completions.create(model=model, prompt="Once upon a time",
                                            max_tokens=6, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


@pytest.mark.parametrize("field", ["structured_outputs", "guided_grammar"])
def test_a_gbnf_grammar_holds_the_output_to_its_language(client: openai.OpenAI, model: str,
                                                         field: str) -> None:
    grammar = 'root ::= answer " " digit\nanswer ::= "yes" | "no"\ndigit ::= [0-9]'
    body = {"structured_outputs": {"grammar": grammar}} if field == "structured_outputs" \
        else {"guided_grammar": grammar}
    for seed in range(3):  # sampled, so each run may take another branch of the grammar
        out = client.completions.create(model=model, prompt="Answer:", max_tokens=16,
                                        temperature=1.0, seed=seed, extra_body=body)
        (choice,) = out.choices
        answer, _, digit = choice.text.partition(" ")
        assert answer in ("yes", "no") and len(digit) == 1 and digit.isdigit(), choice.text
        assert choice.finish_reason == "stop"  # a complete grammar ends the request


def test_a_bad_gbnf_grammar_is_a_400(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="x", max_tokens=4,
                                  extra_body={"structured_outputs": {"grammar": "root ::= ("}})


def test_iterserve_generate_on_the_default_model(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--prompt", "Hello", "--prompt", "The capital of France is",
            "--chat", "Hi there", "--max-tokens", "5", "--ignore-eos", "--json",
            "--no-progress"]
    assert main(argv) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert [x["prompt"] for x in lines] == ["Hello", "The capital of France is", None]
    for x in lines:
        assert isinstance(x["text"], str) and x["text"]
        assert x["finish_reason"] == "length" and len(x["token_ids"]) == 5
        assert x["ttft_s"] > 0


def test_iterserve_generate_prints_text_and_finish_reason(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--max-tokens", "3", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("--- 'Hello, my name is'\n")  # the default prompt
    assert "tokens, finish=" in out
