"""The OpenAI-compatible HTTP server (FastAPI): the app, its routes and error handlers.

The endpoints' logic is in serving.py; refusals before the engine (error shape, body
cap, admission, auth) in guards.py; test-only fault hooks in fault_hooks.py.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from iterserve.engine.async_llm import AsyncLLM, EngineDeadError
from iterserve.entrypoints.guards import (
    APIError,
    APIKeyMiddleware,
    ServerCounters,
    engine_dead,
    validation_error,
)
from iterserve.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from iterserve.entrypoints.serving import OpenAIServing, ServerConfig, _sse
from iterserve.metrics import CONTENT_TYPE

__all__ = ["OpenAIServing", "ServerConfig", "_sse", "build_app"]

logger = logging.getLogger("iterserve.server")


def build_app(engine: AsyncLLM, config: ServerConfig | None = None) -> FastAPI:
    """The ASGI app. Its lifespan starts the engine thread and shuts it down."""
    config = config or ServerConfig()
    serving = OpenAIServing(engine, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await engine.shutdown(drain_timeout_s=config.shutdown_drain_timeout_s)
            serving.tokenization.shutdown()

    docs: dict[str, Any] = {}
    if config.disable_fastapi_docs:
        docs = {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="iterserve", version=_version(), lifespan=lifespan, **docs)
    app.state.engine = engine
    app.state.serving = serving
    counters = ServerCounters(engine.metrics)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail),
                        code="not_found" if exc.status_code == 404 else None).response()

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(raw: Request, _: ClientDisconnect) -> Response:
        # The client left while sending its body: an ordinary event, not an error (and
        # a cheap log flood if each one logged a traceback). Nobody reads the answer.
        counters.client_disconnects.labels(counters.model_name, "body").inc()
        logger.debug("client disconnected during the request body: %s", raw.url.path)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return APIError(500, f"internal error: {type(exc).__name__}",
                        type="server_error").response()

    # The request bodies' schemas (the routes read the body themselves, to cap its size);
    # their shared definitions go to components, where OpenAPI references resolve.
    request_defs: dict = {}

    def body_schema(model: type[BaseModel]) -> dict:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        request_defs.update(schema.pop("$defs", {}))
        return {"requestBody": {"required": True, "content": {
            "application/json": {"schema": schema}}}}

    completion_schema = body_schema(CompletionRequest)
    chat_schema = body_schema(ChatCompletionRequest)
    tokenize_schema = body_schema(TokenizeRequest)
    detokenize_schema = body_schema(DetokenizeRequest)

    @app.post("/v1/completions", openapi_extra=completion_schema)
    async def completions(raw: Request) -> Response:
        return await serving.completions(raw)

    @app.post("/v1/chat/completions", openapi_extra=chat_schema)
    async def chat(raw: Request) -> Response:
        return await serving.chat(raw)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[
            ModelCard(id=name, root=name, max_model_len=serving.max_model_len)
            for name in config.served_model_names
        ])

    @app.get("/health")
    async def health() -> Response:
        if engine.is_healthy:
            return Response(status_code=200)
        return engine_dead(EngineDeadError(f"the engine is not running: {engine.dead_error!r}")
                           ).response()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": _version()}

    @app.post("/tokenize", openapi_extra=tokenize_schema)
    async def tokenize(raw: Request) -> Response:
        return await serving.tokenize(raw)

    @app.post("/detokenize", openapi_extra=detokenize_schema)
    async def detokenize(raw: Request) -> Response:
        return await serving.detokenize(raw)

    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = default_openapi()  # cached in app.openapi_schema: extended once
            doc.setdefault("components", {}).setdefault("schemas", {}).update(request_defs)
        assert app.openapi_schema is not None
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    if config.enable_test_hooks:
        from iterserve.entrypoints.fault_hooks import add_test_hooks

        add_test_hooks(app, engine, serving)

    if config.api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=config.api_keys)
    if config.allowed_origins:  # outermost: a 401 carries the CORS headers too
        app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins,
                           allow_credentials=config.allow_credentials,
                           allow_methods=config.allowed_methods,
                           allow_headers=config.allowed_headers)
    return app


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("iterserve")
    except Exception:
        return "0.0.0"
