"""Operational routes: /health (and /ping), /metrics, /load, /version, /openapi.json, and the legacy
/generate."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from asyncserve import __version__
from asyncserve.http.beam import beam_params, run_beam_search
from asyncserve.http.errors import APIError
from asyncserve.http.openapi import openapi_schema
from asyncserve.http.protocol import (
    GenerateRequest,
    GenerateResponse,
    HealthResponse,
    LoadResponse,
)
from asyncserve.http.sampling import generate_params
from asyncserve.http.serving import PromptInput, ServerState, engine_error
from asyncserve.http.sse import EventStreamResponse, cancel_on_disconnect, closing, ndjson_line
from asyncserve.outputs import RequestOutput
from asyncserve.tracing import trace_headers

logger = logging.getLogger(__name__)


def _json(payload: object, status: int = 200) -> Response:
    return Response(msgspec.json.encode(payload), status_code=status, media_type="application/json")


def _texts(prefix: str, out: RequestOutput) -> list[str]:
    return [prefix + c.text for c in sorted(out.outputs, key=lambda c: c.index)]


async def generate(state: ServerState, request: Request) -> Response:
    """{"prompt", "n", "temperature", "top_p", "max_tokens", "stream"} -> {"text": [...]}."""
    body = await state.read_json(request, GenerateRequest)
    params = generate_params(body, state.generation_config)

    def prepare() -> PromptInput:  # in the preprocessing pool: off the event loop
        if isinstance(body.prompt, str):
            prompt = state.prepare(body.prompt, True, params)
        else:
            prompt = PromptInput(None, list(body.prompt))
        state.validate(prompt, params, "prompt")
        return prompt

    prompt = await state.preprocessor.run(prepare)
    ticket = state.check_ready()
    request_id = state.new_request_id()
    prefix = state.prompt_text(prompt)
    if body.use_beam_search:
        beam, n = beam_params(body, state.engine.max_model_len)
        out = (await run_beam_search(state, [prompt], beam, n, request))[0]
        return _json(GenerateResponse(text=_texts(prefix, out)))
    state.log_request(request_id, prompt, params)
    outputs = ticket.watch(
        state.engine.generate(
            prompt.token_ids, params, request_id, trace_headers=trace_headers(request.headers)
        )
    )
    if body.stream:
        return EventStreamResponse(
            _ndjson(state, outputs, prefix), "application/x-ndjson", keepalive_s=None
        )

    async def final() -> RequestOutput:
        last = None
        async with closing(outputs) as stream:
            async for out in stream:
                last = out
        if last is None:
            raise RuntimeError("the engine ended the request without an output")
        return last

    out = await cancel_on_disconnect(final(), request.receive, request.scope)
    if out.error is not None and not out.internal_error:
        raise engine_error(out, state.engine)
    return _json(GenerateResponse(text=_texts(prefix, out)))


async def _ndjson(
    state: ServerState, outputs: AsyncIterator[RequestOutput], prefix: str
) -> AsyncIterator[bytes]:
    """Newline-delimited JSON, one {"text": [prompt + text so far, ...]} per engine output
    that changed something: a sample that finished early is not sent again on its own."""
    sent: list[str] | None = None
    try:
        async with closing(outputs) as stream:
            async for out in stream:
                if out.error is not None:
                    yield ndjson_line(engine_error(out, state.engine).to_body())
                    return
                texts = _texts(prefix, out)
                if texts != sent:
                    sent = texts
                    yield ndjson_line(GenerateResponse(text=texts))
    except Exception as exc:
        logger.exception("/generate stream failed")
        yield ndjson_line(APIError(f"{type(exc).__name__}: {exc}", 500).to_body())


def health_body(state: ServerState) -> HealthResponse:
    engine = state.engine
    return HealthResponse(
        status="ok" if engine.is_running else "unhealthy",
        num_running=engine.num_running,
        num_waiting=engine.num_waiting,
        num_free_blocks=engine.num_free_blocks,
        num_total_blocks=engine.num_total_blocks,
        kv_cache_usage=engine.kv_cache_usage,
    )


def routes(state: ServerState) -> list[Route]:
    async def health(request: Request) -> Response:
        body = health_body(state)
        return _json(body, 200 if body.status == "ok" else 503)

    async def metrics(request: Request) -> Response:
        await state.metrics.refresh(state.engine)
        payload, content_type = state.metrics.render(state.config.metrics_prefix)
        return Response(payload, headers={"content-type": content_type})

    async def load(request: Request) -> Response:
        # vLLM's shape; counted only with --enable-server-load-tracking (else always 0).
        return _json(LoadResponse(server_load=state.server_load))

    async def version(request: Request) -> Response:
        return _json({"version": __version__})

    schema: list[bytes] = []
    schema_lock = asyncio.Lock()

    def build_schema() -> bytes:
        return msgspec.json.encode(openapi_schema(__version__, state.config.api_key is not None))

    async def openapi(request: Request) -> Response:
        # Built on first use, on a worker thread: it takes about half a second, which a
        # start-up (and the event loop's streams) should not wait for.
        async with schema_lock:
            if not schema:
                schema.append(await asyncio.to_thread(build_schema))
        return Response(schema[0], media_type="application/json")

    async def legacy_generate(request: Request) -> Response:
        return await generate(state, request)

    return [
        Route("/health", health, methods=["GET"]),
        # vLLM's /ping (SageMaker's health check, beside /invocations): /health's answer.
        Route("/ping", health, methods=["GET", "POST"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/load", load, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        Route("/generate", legacy_generate, methods=["POST"]),
    ]
