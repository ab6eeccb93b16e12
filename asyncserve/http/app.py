"""build_app(engine, config) -> Starlette: routes, API-key check, errors in OpenAI's shape,
and a lifespan that starts the engine's step loop on the server's event loop."""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from asyncserve.config import ServerConfig
from asyncserve.http import (
    dashboard,
    routes_kv_transfer,
    routes_lora,
    routes_openai,
    routes_ops,
    routes_pooling,
    routes_tokenize,
)
from asyncserve.http.engine_client import EngineClient
from asyncserve.http.errors import APIError, error_response
from asyncserve.http.middleware import (
    RequestIdMiddleware,
    RootPathMiddleware,
    ServerLoadMiddleware,
    route_path,
)
from asyncserve.http.sampling import resolve_generation_config
from asyncserve.http.serving import ServerState
from asyncserve.http.sse import RAW_SEND_KEY, ClientDisconnected
from asyncserve.metrics import EngineMetrics, ServerMetrics

logger = logging.getLogger(__name__)

# Reachable without an API key: probes, scrapers and load-aware routers.
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/load"})


def default_model_name(model_path: str) -> str:
    """The name a model answers to when --served-model-name is not given."""
    path = Path(model_path)
    return path.stem if path.suffix == ".gguf" else (path.name or model_path)


def _basic_password(credentials: bytes) -> bytes | None:
    """The password of an HTTP Basic `user:password` (base64), or None if malformed."""
    try:
        decoded = base64.b64decode(credentials.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    _, sep, password = decoded.partition(b":")
    return password if sep else None


class APIKeyMiddleware:
    """401 unless `Authorization: Bearer <key>` matches (constant-time), except OPEN_PATHS.
    The dashboard, opened by a browser, also takes the key as an HTTP Basic password."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = route_path(scope) if scope["type"] == "http" else ""
        if scope["type"] != "http" or path in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        browser_page = path == dashboard.DASHBOARD_PATH
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
                break
        # The scheme is case-insensitive (RFC 7235): "bearer <key>" is as good.
        scheme, _, token = given.partition(b" ")
        scheme = scheme.lower()
        if browser_page and scheme == b"basic":
            token = _basic_password(token) or b""
            scheme = b"bearer"
        if scheme != b"bearer" or not hmac.compare_digest(token.strip(), self.expected):
            challenge = 'Basic realm="asyncserve", charset="UTF-8"' if browser_page else "Bearer"
            response = APIError(
                "Invalid or missing API key: send `Authorization: Bearer <key>`",
                401,
                code="invalid_api_key",
                headers={"WWW-Authenticate": challenge},
            ).response()
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class _App(Starlette):
    """Starlette that keeps the server's own `send` in the scope (sse.RAW_SEND_KEY) for
    streams' body messages, which every middleware here passes through unchanged."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[RAW_SEND_KEY] = send
        await super().__call__(scope, receive, send)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"Not found: {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"Method {request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    return error_response(exc.status_code, message, headers=exc.headers)


async def _disconnected(request: Request, exc: Exception) -> Response:
    # Nobody is listening; the engine request was aborted already.
    return Response(status_code=499)


async def _internal_error(request: Request, exc: Exception) -> Response:
    logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(500, "Internal server error")


async def _stop_when_engine_dies(state: ServerState) -> None:
    """A server whose engine failed for good stops (and run_server exits non-zero) so that a
    supervisor restarts it, rather than answering 503 forever."""
    reason = await state.engine.wait_until_dead()
    logger.error("the engine stopped: %s; shutting the server down", reason)
    state.fatal_error = reason
    if state.request_exit is not None:
        state.request_exit()


def build_app(
    engine: EngineClient,
    config: ServerConfig | None = None,
    metrics: ServerMetrics | None = None,
) -> Starlette:
    """The server around `engine`. The lifespan starts the engine loop and, on shutdown,
    lets running requests finish for up to config.shutdown_timeout seconds."""
    config = config or ServerConfig()
    names = config.served_model_names or (default_model_name(engine.model_path),)
    state = ServerState(
        engine=engine,
        config=config,
        model_names=names,
        metrics=metrics or EngineMetrics(names[0]),
        generation_config=resolve_generation_config(
            config.generation_config, engine.generation_config
        ),
    )

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await engine.start()
        logger.info("serving %s as %s", engine.model_path, ", ".join(names))
        watcher = asyncio.create_task(_stop_when_engine_dies(state))
        try:
            yield
        finally:
            watcher.cancel()
            await engine.shutdown(timeout=config.shutdown_timeout)
            state.preprocessor.shutdown()

    loras = routes_lora.LoRARegistry(state)
    loras.register_startup(config.lora_modules)
    app = _App(
        routes=routes_openai.routes(state)
        + routes_pooling.routes(state)
        + routes_kv_transfer.routes(state)
        + routes_ops.routes(state)
        + routes_lora.routes(state, loras)
        + routes_tokenize.routes(state)
        + dashboard.routes(state),
        exception_handlers={
            APIError: _api_error,
            HTTPException: _http_error,
            ClientDisconnected: _disconnected,
            Exception: _internal_error,
        },
        lifespan=lifespan,
    )
    # Added innermost first: root path, request id, CORS, API key, load count, routes.
    if config.enable_server_load_tracking:
        app.add_middleware(ServerLoadMiddleware, state=state)
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(config.allowed_origins),
        allow_methods=list(config.allowed_methods),
        allow_headers=list(config.allowed_headers),
        allow_credentials=config.allow_credentials,
    )
    if config.enable_request_id_headers:
        app.add_middleware(RequestIdMiddleware)
    if config.root_path:
        app.add_middleware(RootPathMiddleware, root_path=config.root_path)
    app.state.asyncserve = state
    transfer = getattr(engine, "kv_transfer", None)
    if transfer is not None:
        transfer.api_key = config.api_key  # pulls from the producer carry this server's key
    return app
