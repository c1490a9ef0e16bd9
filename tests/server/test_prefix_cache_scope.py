"""Prefix-cache isolation over real HTTP: cache_salt, --prefix-caching-scope, and
usage.prompt_tokens_details.cached_tokens (--enable-prompt-tokens-details)."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

from tests.server.helpers import MODEL, ServerThread

BLOCK = 16  # the test servers' block size


@pytest.fixture(scope="module")
def global_server(model_path):
    with ServerThread(model_path, enable_prompt_tokens_details=True) as s:
        yield s


@pytest.fixture(scope="module")
def tenant_server(model_path):
    with ServerThread(model_path, enable_prompt_tokens_details=True,
                      prefix_caching_scope="tenant") as s:
        yield s


def fresh_prompt(n: int = 3 * BLOCK + 5) -> list[int]:
    """Token ids no other test sent (so every hit below comes from this test)."""
    seed = uuid.uuid4().int
    return [5 + (seed >> (i % 100)) % 90 for i in range(n)]


def complete(server, prompt, headers=None, **body) -> dict:
    r = httpx.post(server.base_url + "/v1/completions", headers=headers or {}, timeout=60,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 1, **body})
    assert r.status_code == 200, r.text
    return r.json()


def cached(resp: dict) -> int:
    details = resp["usage"].get("prompt_tokens_details")
    return 0 if details is None else details["cached_tokens"]


def test_global_scope_shares_prefixes_across_clients(global_server):
    prompt = fresh_prompt()
    assert cached(complete(global_server, prompt, {"X-Tenant": "alice"})) == 0
    # Another client sees the hit: the side channel scope=tenant closes.
    assert cached(complete(global_server, prompt, {"X-Tenant": "mallory"})) == 3 * BLOCK


def test_cache_salt_isolates_and_same_salt_shares(global_server):
    prompt = fresh_prompt()
    assert cached(complete(global_server, prompt, cache_salt="s1")) == 0
    assert cached(complete(global_server, prompt, cache_salt="s2")) == 0
    assert cached(complete(global_server, prompt)) == 0  # unsalted: its own chain
    assert cached(complete(global_server, prompt, cache_salt="s1")) == 3 * BLOCK
    assert cached(complete(global_server, prompt)) == 3 * BLOCK


def test_tenant_scope_never_shares_between_tenants(tenant_server):
    prompt = fresh_prompt()
    assert cached(complete(tenant_server, prompt, {"X-Tenant": "alice"})) == 0
    # Same prompt, same (or no) salt, another tenant: no hit, no signal.
    assert cached(complete(tenant_server, prompt, {"X-Tenant": "mallory"})) == 0
    assert cached(complete(tenant_server, prompt, user="eve")) == 0
    assert cached(complete(tenant_server, prompt)) == 0  # anonymous is a tenant too
    # Each tenant's own hits are reported to it.
    assert cached(complete(tenant_server, prompt, {"X-Tenant": "alice"})) == 3 * BLOCK
    assert cached(complete(tenant_server, prompt, user="eve")) == 3 * BLOCK
    # X-Tenant and user name one identity: the same name in either shares.
    assert cached(complete(tenant_server, prompt, user="mallory")) == 3 * BLOCK
    # X-Tenant wins over user (one identity, as for fair-share scheduling).
    assert cached(complete(tenant_server, prompt, {"X-Tenant": "alice"}, user="x")) == 3 * BLOCK


def test_tenant_scope_separates_api_keys(tenant_server):
    # The server has no key of its own here; a gateway in front would authenticate
    # these. The same X-Tenant under two keys is two tenants.
    prompt = fresh_prompt()
    a = {"Authorization": "Bearer key-a", "X-Tenant": "t"}
    b = {"Authorization": "Bearer key-b", "X-Tenant": "t"}
    assert cached(complete(tenant_server, prompt, a)) == 0
    assert cached(complete(tenant_server, prompt, b)) == 0
    assert cached(complete(tenant_server, prompt, a)) == 3 * BLOCK


def test_tenant_scope_same_salt_within_a_tenant_shares(tenant_server):
    prompt = fresh_prompt()
    h = {"X-Tenant": "alice"}
    assert cached(complete(tenant_server, prompt, h, cache_salt="conv-1")) == 0
    assert cached(complete(tenant_server, prompt, h, cache_salt="conv-2")) == 0
    assert cached(complete(tenant_server, prompt, h, cache_salt="conv-1")) == 3 * BLOCK
    # Another tenant with the same salt still misses.
    assert cached(complete(tenant_server, prompt, {"X-Tenant": "bob"},
                           cache_salt="conv-1")) == 0


def test_chat_and_streamed_usage_report_cached_tokens(global_server):
    messages = [{"role": "user", "content": "tell me about " + " ".join(
        uuid.uuid4().hex[:8] for _ in range(6))}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 1, "cache_salt": "chat"}
    url = global_server.base_url + "/v1/chat/completions"
    first = httpx.post(url, json=body, timeout=60).json()
    assert cached(first) == 0 and first["usage"]["prompt_tokens"] > BLOCK
    r = httpx.post(url, json={**body, "stream": True,
                              "stream_options": {"include_usage": True}}, timeout=60)
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    usage = events[-1]["usage"]
    expect = (first["usage"]["prompt_tokens"] - 1) // BLOCK * BLOCK
    assert usage["prompt_tokens_details"] == {"cached_tokens": expect}
    other = httpx.post(url, json={**body, "cache_salt": "other"}, timeout=60).json()
    assert cached(other) == 0


def test_cached_tokens_of_many_prompts_and_samples(global_server):
    p1, p2 = fresh_prompt(), fresh_prompt(2 * BLOCK + 3)
    complete(global_server, p1)
    complete(global_server, p2)
    # Each prompt counts once, whatever n is: 3 blocks + 2 blocks.
    both = complete(global_server, [p1, p2], n=2, temperature=0.0)
    assert len(both["choices"]) == 4
    assert cached(both) == 5 * BLOCK


def test_cached_tokens_hidden_unless_enabled(server):
    prompt = fresh_prompt()
    complete(server, prompt)
    assert complete(server, prompt)["usage"].get("prompt_tokens_details") is None


def test_unknown_scope_is_a_configuration_error():
    from iterserve.entrypoints.serving_base import ServerConfig

    with pytest.raises(ValueError, match="prefix_caching_scope"):
        ServerConfig(prefix_caching_scope="user")


@pytest.mark.parametrize("salt", ["", 5, ["a"], True])
def test_cache_salt_must_be_a_non_empty_string(global_server, salt):
    r = httpx.post(global_server.base_url + "/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 1,
                         "cache_salt": salt})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "cache_salt"
    r = httpx.post(global_server.base_url + "/v1/chat/completions", timeout=30,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                         "max_tokens": 1, "cache_salt": salt})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "cache_salt"
