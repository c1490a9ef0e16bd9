"""Who may share prefix-cache blocks: ``--prefix-caching-scope`` and ``cache_salt``.

A prefix-cache hit is observable (a faster first token, ``cached_tokens`` in the
usage), so with one cache for everyone a client can probe whether anyone else sent
a given prefix. The engine keys blocks by a chain that starts from the request's
``cache_salt`` (core/block_hash.py): requests share blocks only when their salts
are equal. This module turns an HTTP request into that salt:

- ``global`` (default, vLLM's behaviour): the client's own ``cache_salt`` or none;
  every unsalted request shares one cache.
- ``tenant``: the caller's identity is mixed in, so different tenants never share
  a block, whatever salt they send. The identity is the API key the request
  carries (its sha256: the key itself is never kept), and within it ``X-Tenant``,
  else ``user``. Only the key is authenticated: ``X-Tenant`` and ``user`` are what
  the client says, so they separate cooperating clients (or clients behind a
  gateway that sets them), not attackers who share a key.
"""

from __future__ import annotations

import hashlib
import json

from starlette.datastructures import Headers

PREFIX_CACHING_SCOPES = ("global", "tenant")


def effective_cache_salt(
    scope: str, headers: Headers, user: str | None, cache_salt: str | None
) -> str | None:
    """The engine request's ``cache_salt`` under ``scope``."""
    if scope == "global":
        return cache_salt
    if scope != "tenant":
        raise ValueError(f"prefix_caching_scope must be one of "
                         f"{', '.join(PREFIX_CACHING_SCOPES)}, got {scope!r}")
    auth = headers.get("authorization")
    key = hashlib.sha256(auth.encode("utf-8", "surrogatepass")).hexdigest() if auth else ""
    tenant = headers.get("x-tenant") or user or ""
    # A JSON list keeps the parts apart: no (key, tenant, salt) aliases another.
    return json.dumps(["tenant", key, tenant, cache_salt], ensure_ascii=True)
