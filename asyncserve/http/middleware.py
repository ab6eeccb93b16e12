"""ASGI middleware for vLLM's server options: --root-path, --enable-request-id-headers and
--enable-server-load-tracking (CORS is Starlette's CORSMiddleware, see app.py)."""

from __future__ import annotations

import uuid

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from asyncserve.http.serving import ServerState

# Routes whose requests count toward /load's server_load (vLLM counts its generation routes).
LOAD_TRACKED_PATHS = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/chat/completions/batch",
        "/invocations",
        "/generate",
    }
)


def route_path(scope: Scope) -> str:
    """The request's path without the root path, when it starts with it (as Starlette's
    router matches it)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root) : len(root) + 1] in ("/", ""):
        return path[len(root) :] or "/"
    return path


class RootPathMiddleware:
    """Serves the app under `root_path` as FastAPI(root_path=...) does in vLLM: a request
    for /llm/v1/models (a proxy that keeps the prefix) and one for /v1/models (a proxy that
    strips it) both reach /v1/models; Starlette's router drops the prefix when it is there."""

    def __init__(self, app: ASGIApp, root_path: str) -> None:
        self.app = app
        self.root_path = root_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            scope = dict(scope)
            scope["root_path"] = self.root_path
        await self.app(scope, receive, send)


class RequestIdMiddleware:
    """Every response carries X-Request-Id: the request's own, else a fresh one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = ""
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                request_id = value.decode("latin-1")
                break
        request_id = request_id or uuid.uuid4().hex

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).append("X-Request-Id", request_id)
            await send(message)

        await self.app(scope, receive, send_with_id)


class ServerLoadMiddleware:
    """Counts generation requests from arrival until their response (streams included) is
    over, for /load."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        if route_path(scope) not in LOAD_TRACKED_PATHS:
            await self.app(scope, receive, send)
            return
        self.state.server_load += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.server_load -= 1
