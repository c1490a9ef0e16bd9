"""What refuses a request before the engine sees it: errors in OpenAI's shape, the
body-size cap and JSON parsing, admission control (429) and API-key auth (401).

Split out of server.py; server.py re-exports these names.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

if TYPE_CHECKING:
    from iterserve.entrypoints.server_config import ServerConfig

M = TypeVar("M", bound=BaseModel)

# Open without an API key, as vLLM leaves them: probes and scrapers carry no key.
UNPROTECTED_PATHS = frozenset({"/health", "/metrics", "/version"})


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code if self.code is not None else self.status_code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def engine_dead(e: BaseException) -> APIError:
    return APIError(503, str(e), type="service_unavailable_error", code="engine_unavailable")


def step_failed(e: BaseException) -> APIError:
    return APIError(500, f"the engine failed while serving this request: {e}",
                    type="server_error", code="engine_step_failed")


def param_of(exc: ValueError) -> str | None:
    """SamplingParams messages start with the field's name."""
    word = str(exc).split(" ", 1)[0]
    return word if word.isidentifier() else None


# --- admission control ---------------------------------------------------------------


class Reservation:
    """What one HTTP request holds against the admission caps; released exactly once."""

    __slots__ = ("_admission", "num_requests", "num_tokens")

    def __init__(self, admission: Admission, num_requests: int) -> None:
        self._admission: Admission | None = admission
        self.num_requests = num_requests
        self.num_tokens = 0

    def release(self) -> None:
        a = self._admission
        if a is not None:
            self._admission = None
            a.num_requests -= self.num_requests
            a.num_tokens -= self.num_tokens
            a.metrics.num_requests_admitted.set(a.num_requests)


class Admission:
    """Caps on admitted, unfinished work. Check-and-reserve is one synchronous block on
    the event loop (no await inside), so concurrent requests cannot overshoot a cap.
    Request slots are reserved before any tokenization; tokens right after it."""

    def __init__(self, config: ServerConfig, metrics: Any) -> None:
        self.max_requests = config.max_num_queued_requests
        self.max_tokens = config.max_num_queued_tokens
        self.status_code = config.reject_status_code
        self.retry_after_s = config.retry_after_s
        self.metrics = metrics
        self.num_requests = 0
        self.num_tokens = 0

    def _reject(self, reason: str, message: str) -> APIError:
        self.metrics.observe_rejection(reason)
        return APIError(
            self.status_code,
            message,
            type="rate_limit_error" if self.status_code == 429 else "service_unavailable_error",
            code="queue_full",
            headers={"Retry-After": str(self.retry_after_s)},
        )

    def reserve_requests(self, num_requests: int) -> Reservation:
        cap = self.max_requests
        if cap is not None and self.num_requests + num_requests > cap:
            if num_requests > cap:
                raise bad_request(
                    f"this request asks for {num_requests} sequences (n x prompts), more than "
                    f"the server admits at once ({cap})",
                    param="n",
                )
            raise self._reject(
                "max_num_queued_reqs",
                f"the server is at capacity ({self.num_requests} of {cap} sequences admitted); "
                "retry later",
            )
        self.num_requests += num_requests
        self.metrics.num_requests_admitted.set(self.num_requests)
        return Reservation(self, num_requests)

    def reserve_tokens(self, reservation: Reservation, num_tokens: int) -> None:
        cap = self.max_tokens
        if cap is not None and self.num_tokens + num_tokens > cap:
            if num_tokens > cap:
                raise bad_request(
                    f"this request needs {num_tokens} tokens of work (prompt + max_tokens per "
                    f"sequence), more than the server admits at once ({cap})",
                    param="max_tokens",
                )
            raise self._reject(
                "max_num_queued_tokens",
                f"the server is at capacity ({self.num_tokens} of {cap} tokens admitted); "
                "retry later",
            )
        self.num_tokens += num_tokens
        reservation.num_tokens += num_tokens


class ServerCounters:
    """The HTTP layer's own counters, in the engine's metrics registry (so /metrics
    shows them beside the engine's, under the same prefix)."""

    def __init__(self, metrics: Any) -> None:
        from prometheus_client import Counter

        self.model_name = getattr(metrics, "_model_name", "")
        self.client_disconnects = Counter(
            f"{metrics.prefix}:client_disconnects",
            "Clients that went away mid-request, by stage (body: while sending it).",
            ["model_name", "stage"],
            registry=metrics.registry,
        )
        self.client_disconnects.labels(self.model_name, "body")


# --- auth ----------------------------------------------------------------------------


class APIKeyMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware, which interferes with streaming and
    disconnect detection): every path but ``UNPROTECTED_PATHS`` needs
    ``Authorization: Bearer KEY`` with one of the keys; a CORS preflight (OPTIONS)
    carries none and passes, as in vLLM."""

    def __init__(self, app: Any, api_keys: list[str]) -> None:
        self.app = app
        # Digests, so every comparison takes the same time whatever the key's length.
        self.expected = [hashlib.sha256(f"Bearer {k}".encode()).digest() for k in api_keys]

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        path = scope["path"]
        root = scope.get("root_path") or ""
        if root and path.startswith(root):
            path = path[len(root):] or "/"
        if path in UNPROTECTED_PATHS:
            return await self.app(scope, receive, send)
        auth = b""
        for k, v in scope["headers"]:
            if k == b"authorization":
                auth = v
                break
        digest = hashlib.sha256(auth).digest()
        ok = False
        for expected in self.expected:
            ok |= secrets.compare_digest(digest, expected)
        if ok:
            return await self.app(scope, receive, send)
        err = APIError(
            401,
            "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
            code="invalid_api_key",
        )
        await err.response()(scope, receive, send)


# --- helpers -------------------------------------------------------------------------


async def read_json(raw: Request, limit: int) -> Any:
    """The body as JSON, refusing bodies over ``limit`` bytes without reading them all."""
    return decode_json(await read_body(raw, limit))


async def read_body(raw: Request, limit: int) -> bytes:
    """The body's bytes, refusing bodies over ``limit`` bytes without reading them all."""
    length = raw.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise bad_request(f"request body is {length} bytes; the limit is {limit}",
                          code="request_too_large")
    chunks: list[bytes] = []
    size = 0
    async for chunk in raw.stream():
        size += len(chunk)
        if size > limit:
            raise bad_request(f"request body exceeds the limit of {limit} bytes",
                              code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def decode_json(data: bytes) -> Any:
    """``data`` parsed as strict JSON (no NaN), its strings valid Unicode (else a 400)."""
    try:
        body = json.loads(data, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    # A lone surrogate can only arrive as a \uD8xx-\uDFxx escape (UTF-8 cannot carry
    # one): walk the body only when the bytes hold such an escape. No backslash at all
    # (one memchr) skips the regex, a scan of the whole body that holds the GIL.
    if b"\\" in data and _SURROGATE_ESCAPE.search(data):
        check_unicode(body)
    return body


def _reject_constant(name: str) -> Any:
    # Python's json accepts NaN and Infinity; JSON (and every sampler) does not.
    raise ValueError(f"{name} is not valid JSON")


# JSON's \\uD800 escapes decode to lone UTF-16 surrogates: valid Python strings that no
# tokenizer, UTF-8 encoder or response writer accepts.
_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def find_surrogate(body: Any) -> str | None:
    """The path ("messages.0.content") of the first string in ``body`` (keys included)
    that holds a lone surrogate, or None. One walk for every field, known or not;
    numbers (a long token-id prompt) cost a type check each, no path."""
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if _bad(value):
                return path or "body"
            continue
        if not isinstance(value, dict | list):
            continue
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, v in items:
            if isinstance(k, str) and _bad(k):
                return path or "body"
            if isinstance(v, str | dict | list):
                stack.append((v, f"{path}.{k}" if path else str(k)))
    return None


def _bad(s: str) -> bool:
    return not s.isascii() and _SURROGATE.search(s) is not None


def check_unicode(body: Any) -> None:
    """400 naming the field when a string in ``body`` holds a lone surrogate."""
    bad = find_surrogate(body)
    if bad is not None:
        # The path may hold the client's key text: keep only what prints safely.
        param = bad.encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace")
        raise bad_request(f"{param}: strings must be valid Unicode (a lone UTF-16 surrogate "
                          "is not)", param=param, code="invalid_unicode")


def parse_body(model: type[M], body: Any) -> M:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


def validation_error(errors: Any) -> APIError:
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    # Union members add their type name to the location; keep the field path only.
    path = []
    for part in loc:
        if part.isdigit() or part.isidentifier():
            path.append(part)
    param = ".".join(path) or None
    msg = str(first.get("msg", "invalid value"))
    return bad_request(f"{param}: {msg}" if param else msg, param=param)
