"""The serving layer hands the engine (or a cluster's router) each request's routing keys:
its prefix-cache salt and its session (X-Session-Id, else the OpenAI `user` field)."""

from __future__ import annotations

import httpx

from tests.server.helpers import MODEL


def test_session_key_and_cache_salt_reach_the_engine(server, monkeypatch):
    seen: list[dict] = []
    real = server.engine.generate

    def spy(*args, **kwargs):
        seen.append({k: kwargs.get(k) for k in ("cache_salt", "session_key")})
        return real(*args, **kwargs)

    monkeypatch.setattr(server.engine, "generate", spy)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    for extra, headers in [({"user": "u1"}, {}), ({"user": "u1"}, {"X-Session-Id": "s9"}),
                           ({"cache_salt": "salt", "stream": True}, {})]:
        r = httpx.post(server.base_url + "/v1/completions", json={**body, **extra},
                       headers=headers)
        assert r.status_code == 200, r.text
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(server.base_url + "/v1/chat/completions", json=chat,
                   headers={"X-Session-Id": "s2"})
    assert r.status_code == 200, r.text
    assert [s["session_key"] for s in seen] == ["u1", "s9", None, "s2"]
    assert seen[2]["cache_salt"] == "salt"
