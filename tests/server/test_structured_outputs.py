"""Structured outputs through the official openai client: response_format (json_schema,
json_object), vLLM's structured_outputs, the pydantic `parse` helper, and the 400s."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.helpers import MODEL

MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
# Small random models fill JSON with blanks unless whitespace is ruled out.
NO_WS = {"structured_outputs": {"disable_any_whitespace": True}}


class Person(BaseModel):
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.mark.parametrize("stream", [False, True])
def test_chat_json_schema(client, stream):
    kwargs = dict(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=64,
        temperature=0.8,
        seed=4,
        n=3,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}},
        extra_body=NO_WS,
    )
    if stream:
        texts = {0: "", 1: "", 2: ""}
        finish = {}
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
                if c.finish_reason:
                    finish[c.index] = c.finish_reason
        assert finish == {0: "stop", 1: "stop", 2: "stop"}
    else:
        resp = client.chat.completions.create(**kwargs)
        texts = {c.index: c.message.content for c in resp.choices}
        assert all(c.finish_reason == "stop" for c in resp.choices)
    for text in texts.values():
        jsonschema.validate(json.loads(text), SCHEMA)


def test_parse_with_a_pydantic_model(client):
    completion = client.beta.chat.completions.parse(
        model=MODEL, messages=MESSAGES, response_format=Person, max_tokens=64,
        temperature=0, extra_body=NO_WS,
    )
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person)


def test_completions_with_vllm_structured_outputs_and_unconstrained_neighbours(client):
    # Constrained and unconstrained requests in flight together (same engine steps).
    import concurrent.futures as cf

    def constrained(i):
        r = client.completions.create(
            model=MODEL, prompt=f"Code {i}:", max_tokens=16, temperature=1.0, seed=i,
            extra_body={"structured_outputs": {"regex": r"[A-Z]{2}-[0-9]{3}"}},
        )
        return r.choices[0]

    def free(i):
        return client.completions.create(
            model=MODEL, prompt=f"Free {i}:", max_tokens=12, temperature=0,
            extra_body={"ignore_eos": True},
        ).choices[0]

    with cf.ThreadPoolExecutor(8) as pool:
        cs = [pool.submit(constrained, i) for i in range(4)]
        fs = [pool.submit(free, i) for i in range(4)]
        for f in cs:
            c = f.result()
            assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", c.text) and c.finish_reason == "stop"
        for f in fs:
            assert f.result().finish_reason == "length"


def test_choice_and_guided_alias_and_json_object(client):
    r = client.completions.create(
        model=MODEL, prompt="Yes or no?", max_tokens=8, temperature=0,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert r.choices[0].text in ("yes", "no")
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=48, temperature=0.5, seed=2,
        response_format={"type": "json_object"},
    )
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": "json"}, "response_format"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"grammer": "x"}}, "structured_outputs"),
        ({"structured_outputs": {"choice": ["a"]}, "guided_regex": "b"}, "guided_regex"),
    ],
)
def test_constraints_the_engine_cannot_honour_are_400s(server, body, param):
    r = httpx.post(server.base_url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
