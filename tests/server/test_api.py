"""The OpenAI API through the official client and raw HTTP: completions and chat,
streaming and not, n, stop strings, logprobs, usage, tokenize."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server.helpers import MODEL

GREEDY = {"temperature": 0.0}
PROMPT = "The quick brown fox jumps over"
MESSAGES = [{"role": "user", "content": "Hello, world! How are you today?"}]


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def sse_events(text: str) -> list:
    """The data: payloads of an SSE body, '[DONE]' kept as a string."""
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def num_tokens(server, text: str) -> int:
    return httpx.post(server.base_url + "/tokenize", json={"prompt": text}).json()["count"]


def test_models_health_version(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert httpx.get(server.base_url + "/version").json()["version"]


def test_completion_usage_and_lengths(server, client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=7,
                                  extra_body={"ignore_eos": True}, **GREEDY)
    assert r.object == "text_completion" and r.model == MODEL
    (choice,) = r.choices
    assert choice.finish_reason == "length" and choice.text
    assert r.usage.prompt_tokens == num_tokens(server, PROMPT)
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_stream_equals_non_stream_greedy(client, api):
    extra = {"ignore_eos": True}
    if api == "completions":
        full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24,
                                         extra_body=extra, **GREEDY)
        chunks = list(client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=24, stream=True,
            stream_options={"include_usage": True}, extra_body=extra, **GREEDY))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        want = full.choices[0].text
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24,
                                              extra_body=extra, **GREEDY)
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=24, stream=True,
            stream_options={"include_usage": True}, extra_body=extra, **GREEDY))
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        want = full.choices[0].message.content
        assert full.choices[0].message.role == "assistant"
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    assert text == want and text
    assert finish == "length" == full.choices[0].finish_reason
    # include_usage: one final chunk, empty choices, the same usage as non-streamed.
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.model_dump() == full.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


def test_raw_sse_shape_and_done(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "stream": True, **GREEDY}
    r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert all(e["object"] == "text_completion" for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_n2(client, stream):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=6, n=2, temperature=1.0, seed=7,
              extra_body={"ignore_eos": True})
    if stream:
        texts = {0: "", 1: ""}
        finished = set()
        for c in client.completions.create(stream=True, **kw):
            for ch in c.choices:
                texts[ch.index] += ch.text
                if ch.finish_reason:
                    finished.add(ch.index)
        assert finished == {0, 1}
    else:
        r = client.completions.create(**kw)
        assert sorted(ch.index for ch in r.choices) == [0, 1]
        assert r.usage.completion_tokens == 12
        texts = {ch.index: ch.text for ch in r.choices}
    assert all(texts.values())
    # Seeded: the same request samples the same texts again.
    again = client.completions.create(**kw)
    assert {ch.index: ch.text for ch in again.choices} == texts


def test_chat_n2_and_batch_prompts(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, n=2,
                                       **GREEDY)
    assert [c.index for c in r.choices] == [0, 1]
    # Greedy children agree.
    assert r.choices[0].message.content == r.choices[1].message.content
    # Batched prompts (text and token ids): choice i*n + j.
    r = client.completions.create(model=MODEL, prompt=[PROMPT, "Hello"], max_tokens=3, n=2,
                                  extra_body={"ignore_eos": True}, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text
    assert r.choices[2].text == r.choices[3].text
    r2 = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=3, **GREEDY)
    assert r2.usage.prompt_tokens == 4


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string(server, client, stream):
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24,
                                     extra_body={"ignore_eos": True}, **GREEDY).choices[0].text
    assert len(base) >= 6
    stop = base[3:6]
    head = base[: base.index(stop)]
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=24, stop=[stop],
              extra_body={"ignore_eos": True}, **GREEDY)
    if stream:
        chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw)]
        text = "".join(c.text for c in chunks)
        finish, reason = chunks[-1].finish_reason, chunks[-1].model_extra.get("stop_reason")
    else:
        ch = client.completions.create(**kw).choices[0]
        text, finish, reason = ch.text, ch.finish_reason, ch.model_extra.get("stop_reason")
    assert text == head
    assert finish == "stop" and reason == stop
    # Ended on the server side by the stop string: the engine let the request go too.
    server.wait_idle()


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs(client, stream):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=5, logprobs=3,
              extra_body={"ignore_eos": True}, **GREEDY)
    if stream:
        lps = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kw)
               if c.choices and c.choices[0].logprobs]
        tokens = [x for lp in lps for x in lp.tokens]
        token_lps = [x for lp in lps for x in lp.token_logprobs]
        tops = [x for lp in lps for x in lp.top_logprobs]
        offsets = [x for lp in lps for x in lp.text_offset]
    else:
        lp = client.completions.create(**kw).choices[0].logprobs
        tokens, token_lps, tops, offsets = lp.tokens, lp.token_logprobs, lp.top_logprobs, \
            lp.text_offset
    assert len(tokens) == len(token_lps) == len(tops) == len(offsets) == 5
    assert offsets == sorted(offsets) and offsets[0] == 0
    for lp_, top in zip(token_lps, tops):
        assert lp_ <= 0.0
        assert 1 <= len(top) <= 4
        # Greedy: the sampled token is the most likely one.
        assert lp_ == pytest.approx(max(top.values()), abs=1e-5)


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                       logprobs=True, top_logprobs=2,
                                       extra_body={"ignore_eos": True}, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for t in content:
        assert len(t.top_logprobs) == 2
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-5)
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, logprobs=True, top_logprobs=2,
        stream=True, extra_body={"ignore_eos": True}, **GREEDY))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]


def test_tokenize_detokenize(server):
    r = httpx.post(server.base_url + "/tokenize",
                   json={"model": MODEL, "prompt": PROMPT, "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"]) > 0
    assert r["max_model_len"] == 256
    d = httpx.post(server.base_url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert d["prompt"] == PROMPT
    chat = httpx.post(server.base_url + "/tokenize", json={"messages": MESSAGES}).json()
    assert chat["count"] > r["count"]


def test_priority_and_tenant_reach_the_scheduler(server):
    seen: list[tuple[int, str]] = []

    def spy(sched_out) -> None:
        seen.extend((r.priority, r.tenant) for r in sched_out.scheduled_requests)

    server.engine.set_fault_hook(spy)
    try:
        url = server.base_url + "/v1/completions"
        httpx.post(url, json={"prompt": PROMPT, "max_tokens": 2, "priority": 3, "user": "alice"})
        httpx.post(url, json={"prompt": PROMPT, "max_tokens": 2, "user": "alice"},
                   headers={"X-Tenant": "bob"})
        httpx.post(server.base_url + "/v1/chat/completions",
                   json={"messages": MESSAGES, "max_tokens": 2, "priority": -1})
    finally:
        server.engine.set_fault_hook(None)
    assert {(3, "alice"), (0, "bob"), (-1, "default")} <= set(seen)


def test_echo_and_token_id_prompts(server, client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, echo=True, **GREEDY)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, **GREEDY)
    assert r.choices[0].text == PROMPT + plain.choices[0].text
    ids = httpx.post(server.base_url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, **GREEDY)
    assert by_ids.choices[0].text == plain.choices[0].text
    for bad in ([10**9], [-1]):
        r = httpx.post(server.base_url + "/v1/completions", json={"prompt": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(server.base_url + "/v1/completions",
                   content=b'{"prompt": "x", "temperature": NaN}')
    assert r.status_code == 400


def test_stream_interval_batches_chunks(server, client):
    """vLLM's per-request stream_interval: the first token alone, then chunks of five;
    the same text as without it. Below 1 is a 400 naming the field."""
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=11, extra_body={"ignore_eos": True},
              **GREEDY)
    want = client.completions.create(**kw).choices[0].text
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 11, "ignore_eos": True,
            "temperature": 0.0, "stream": True, "stream_interval": 5, "logprobs": 0}
    events = sse_events(httpx.post(server.base_url + "/v1/completions", json=body,
                                   timeout=30).text)
    choices = [e["choices"][0] for e in events if e != "[DONE]" and e["choices"]]
    sizes = [len(c["logprobs"]["tokens"]) for c in choices if c.get("logprobs")]
    assert sizes == [1, 5, 5]
    assert "".join(c["text"] for c in choices) == want
    assert choices[-1]["finish_reason"] == "length"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, stream=True,
                                  extra_body={"stream_interval": 0})
    assert e.value.body["param"] == "stream_interval"
