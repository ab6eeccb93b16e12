"""`python -m asyncserve proxy --prefill URL... --decode URL...`: an OpenAI-compatible router
for disaggregated prefill.

Each completion or chat request goes first to a prefill instance (a kv_producer) with
max_tokens 1 and kv_transfer_params {"do_remote_decode": true}; its answer names the KV
blocks it keeps. The request then goes, unchanged but for those kv_transfer_params (plus the
producer's URL), to a decode instance (a kv_consumer), which pulls the blocks it lacks and
generates; its answer, streamed or not, is the client's. Instances are taken in turn; one that
cannot be reached is skipped for FAILOVER_S and the next one of its role is tried. With no
prefill instance up, the decode instance computes the prompt itself.

Bodies are read as the server reads them (http/limits.py): 413 over --max-request-body-bytes
(from Content-Length before anything is read), 408 when slower than --timeout-request-body,
400 when nested deeper than the JSON limit.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from asyncserve.cli_server import _positive_or_none, parse_bytes
from asyncserve.http.errors import APIError
from asyncserve.http.limits import check_json_depth, read_body

if TYPE_CHECKING:
    import httpx

logger = logging.getLogger(__name__)

FAILOVER_S = 10.0
# The client's request headers passed on to the instances.
FORWARDED = ("authorization", "content-type", "x-request-id", "traceparent", "tracestate")
# The proxy does not know its instances' models: its default bound fits a long context plus
# a few large images; each instance still applies its own (usually tighter) limit.
DEFAULT_BODY_BYTES = 64 * 1024 * 1024
DEFAULT_BODY_TIMEOUT_S = 60.0


class Pool:
    """Instances of one role, taken in turn; one that failed sits out FAILOVER_S."""

    def __init__(self, role: str, urls: list[str]) -> None:
        if not urls:
            raise ValueError(f"give at least one --{role} URL")
        self.role = role
        self.urls = [u.rstrip("/") for u in urls]
        self._turn = itertools.cycle(range(len(self.urls)))
        self._down_until: dict[str, float] = {}

    def order(self) -> list[str]:
        """Every instance, the next in turn first and those marked down last."""
        start = next(self._turn)
        ring = self.urls[start:] + self.urls[:start]
        now = time.monotonic()
        return sorted(ring, key=lambda u: self._down_until.get(u, 0.0) > now)

    def mark_down(self, url: str, why: str) -> None:
        logger.warning("%s instance %s is down: %s", self.role, url, why)
        self._down_until[url] = time.monotonic() + FAILOVER_S


class Unreachable(Exception):
    pass


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "proxy_error", "param": None, "code": status}},
        status_code=status,
        headers=headers,
    )


def build_proxy(
    prefill: list[str],
    decode: list[str],
    timeout_s: float = 600.0,
    body_limit: int = DEFAULT_BODY_BYTES,
    body_timeout_s: float | None = DEFAULT_BODY_TIMEOUT_S,
) -> Starlette:
    import httpx  # here: `serve` builds this module's flags and needs no HTTP client

    prefills, decodes = Pool("prefill", prefill), Pool("decode", decode)
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0))

    def headers_of(request: Request) -> dict[str, str]:
        return {k: v for k, v in request.headers.items() if k.lower() in FORWARDED}

    async def prefill_step(path: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
        """The producer's kv_transfer_params (with its URL), or a Response to give back."""
        one = {**body, "max_tokens": 1, "stream": False, "n": 1,
               "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
        one.pop("stream_options", None)
        if "max_completion_tokens" in one:
            one["max_completion_tokens"] = 1
        for url in prefills.order():
            try:
                reply = await client.post(url + path, json=one, headers=headers)
            except httpx.TransportError as exc:
                prefills.mark_down(url, str(exc) or type(exc).__name__)
                continue
            if reply.status_code >= 500:
                prefills.mark_down(url, f"HTTP {reply.status_code}")
                continue
            if reply.status_code != 200:  # the request's own fault: the client hears it
                return Response(reply.content, reply.status_code, media_type="application/json")
            params = reply.json().get("kv_transfer_params")
            return {**params, "remote_url": url} if params else None
        logger.warning("no prefill instance is up: the decode instance computes the prompt")
        return None

    async def route(request: Request) -> Response:
        path = request.url.path
        try:
            raw = await read_body(request, body_limit, body_timeout_s)
            check_json_depth(raw)
            body = json.loads(raw)
        except APIError as exc:
            return _error(exc.status, exc.message, exc.headers)
        except ClientDisconnect:
            logger.info("client disconnected while sending %s", path)
            return Response(status_code=499)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            return _error(400, "the request body is not valid JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        headers = headers_of(request)
        transfer = await prefill_step(path, body, headers) if _one_sequence(body) else None
        if isinstance(transfer, Response):
            return transfer
        # Only the producer's kv_transfer_params go on: a client's own would aim the decode
        # instance's pull at any URL it likes.
        full = {k: v for k, v in body.items() if k != "kv_transfer_params"}
        if transfer:
            full["kv_transfer_params"] = transfer
        for url in decodes.order():
            try:
                return await _forward(client, url + path, full, headers, bool(body.get("stream")))
            except Unreachable as exc:
                decodes.mark_down(url, str(exc))
        return _error(503, "no decode instance is reachable")

    async def models(request: Request) -> Response:
        for url in decodes.order():
            try:
                reply = await client.get(url + "/v1/models", headers=headers_of(request))
            except httpx.TransportError as exc:
                decodes.mark_down(url, str(exc) or type(exc).__name__)
                continue
            return Response(reply.content, reply.status_code, media_type="application/json")
        return _error(503, "no decode instance is reachable")

    async def health(request: Request) -> Response:
        status: dict[str, dict[str, bool]] = {"prefill": {}, "decode": {}}
        for pool in (prefills, decodes):
            for url in pool.urls:
                try:
                    ok = (await client.get(url + "/health", timeout=2.0)).status_code == 200
                except httpx.TransportError:
                    ok = False
                status[pool.role][url] = ok
        up = any(status["decode"].values())
        return JSONResponse(status, status_code=200 if up else 503)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await client.aclose()

    return Starlette(
        routes=[
            Route("/v1/completions", route, methods=["POST"]),
            Route("/v1/chat/completions", route, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
        ],
        lifespan=lifespan,
    )


def _one_sequence(body: dict[str, Any]) -> bool:
    """Disaggregated prefill serves one prompt and one sequence (a consumer refuses
    kv_transfer_params with n > 1): anything else goes whole to a decode instance, rather
    than failing there while the producer holds blocks nobody pulls."""
    prompt = body.get("prompt")
    batch = isinstance(prompt, list) and any(isinstance(p, (str, list)) for p in prompt)
    return body.get("n") in (None, 1) and not body.get("use_beam_search") and not batch


async def _forward(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str], stream: bool
) -> Response:
    """The decode instance's answer as the client's; Unreachable before it starts."""
    import httpx

    try:
        upstream = await client.send(client.build_request("POST", url, json=body, headers=headers),
                                     stream=True)  # fmt: skip
    except httpx.TransportError as exc:
        raise Unreachable(str(exc) or type(exc).__name__) from exc
    if not stream or upstream.status_code != 200:
        content = await upstream.aread()
        await upstream.aclose()
        return Response(content, upstream.status_code, media_type="application/json")

    async def relay() -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.TransportError as exc:
            # The decode instance went away mid-stream: end with an error event.
            message = json.dumps({"error": {"message": f"the decode instance failed: {exc}"}})
            yield f"data: {message}\n\ndata: [DONE]\n\n".encode()
        finally:
            await upstream.aclose()

    return StreamingResponse(relay(), media_type="text/event-stream")


def add_proxy_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", nargs="+", required=True, help="prefill instances' URLs")
    parser.add_argument("--decode", nargs="+", required=True, help="decode instances' URLs")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--max-request-body-bytes",
        type=parse_bytes,
        default=DEFAULT_BODY_BYTES,
        help="larger request bodies get 413 before they are read (default 64M)",
    )
    parser.add_argument(
        "--timeout-request-body",
        type=_positive_or_none,
        default=DEFAULT_BODY_TIMEOUT_S,
        help="seconds a request gets to send its whole body, then 408 (0: none)",
    )


def run_proxy(args: argparse.Namespace) -> int:
    logging.basicConfig(level="INFO", format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    try:
        app = build_proxy(
            args.prefill,
            args.decode,
            body_limit=args.max_request_body_bytes,
            body_timeout_s=args.timeout_request_body,
        )
    except ValueError as exc:
        print(f"asyncserve proxy: error: {exc}")
        return 2
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0
