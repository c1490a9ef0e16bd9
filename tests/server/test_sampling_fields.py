"""vLLM's sampling fields over HTTP: logit_bias, allowed_token_ids, truncate_prompt_tokens,
and the refusals (out-of-vocabulary ids, use_beam_search)."""

from __future__ import annotations

import httpx

PROMPT = "The quick brown fox"


def test_over_http(server):
    url = server.base_url + "/v1/completions"
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    r = httpx.post(url, json={**body, "logit_bias": {"77": 100}, "logprobs": 1})
    assert r.status_code == 200, r.text
    assert all(t == r.json()["choices"][0]["logprobs"]["tokens"][0]
               for t in r.json()["choices"][0]["logprobs"]["tokens"])
    r = httpx.post(url, json={**body, "allowed_token_ids": [5, 6]})
    assert r.status_code == 200
    for bad, param in [({"logit_bias": {"abc": 1}}, "logit_bias"),
                       ({"logit_bias": {"99999999": 1}}, "logit_bias"),
                       ({"allowed_token_ids": [99999999]}, "allowed_token_ids"),
                       ({"use_beam_search": True}, "use_beam_search"),
                       ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens")]:
        r = httpx.post(url, json={**body, **bad})
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"] == param
    full = httpx.post(url, json=body).json()["usage"]["prompt_tokens"]
    cut = httpx.post(url, json={**body, "truncate_prompt_tokens": 2}).json()
    assert full > 2 and cut["usage"]["prompt_tokens"] == 2
