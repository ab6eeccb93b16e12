"""Pooling routes: /v1/embeddings (OpenAI), /pooling, /score and /rerank (vLLM's shapes).

They need a pooling model (`--runner pooling`, or inferred from the checkpoint); against a
generating model they answer 400 naming what to do instead.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import torch
import torch.nn.functional as F
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from asyncserve.http.errors import APIError, from_value_error
from asyncserve.http.protocol_pooling import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingData,
    PoolingResponse,
    PoolingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from asyncserve.http.serving import ServerState
from asyncserve.http.sse import cancel_on_disconnect
from asyncserve.pooling.engine import PoolingEngine


def _json(payload: object) -> Response:
    return Response(msgspec.json.encode(payload), media_type="application/json")


def _pooling_engine(state: ServerState) -> PoolingEngine:
    engine = state.engine
    if not isinstance(engine, PoolingEngine):
        raise APIError(
            "the served model generates text and does not pool: serve an embedding or "
            "cross-encoder model (--runner pooling) for this route",
            400,
            "model",
        )
    if not engine.is_running:
        raise APIError("the engine is not running", 503, headers={"Retry-After": "5"})
    return engine


def _encode_vector(vec: torch.Tensor, fmt: str) -> list[float] | str:
    if fmt == "base64":  # little-endian float32, as OpenAI's clients decode it
        return base64.b64encode(vec.numpy().astype("<f4").tobytes()).decode()
    return vec.tolist()


async def _run(request: Request, field: str, coro: Any, fields: Sequence[str] = ()) -> Any:
    """The engine's ValueErrors as 400s; `fields`: the request's fields an error may name
    first (a score's text_1, a rerank's query), else `field`. A client going away cancels the
    work, and so does the shutdown deadline (a JSON 503, as on the completion routes)."""
    try:
        return await cancel_on_disconnect(coro, request.receive, request.scope)
    except ValueError as exc:
        raise from_value_error(exc, field, {f: f for f in fields}) from exc


def _usage(batches: Sequence[Sequence[int]]) -> PoolingUsage:
    n = sum(len(b) for b in batches)
    return PoolingUsage(prompt_tokens=n, total_tokens=n)


def _items(raw: Any) -> list[Any]:
    """OpenAI's `input`: a string, strings, token ids, or lists of token ids."""
    if isinstance(raw, str) or (raw and all(_is_int(x) for x in raw)):
        return [raw]
    if not raw:
        raise APIError("input must not be empty", 400, "input")
    for i, item in enumerate(raw):
        if not (isinstance(item, str) or (isinstance(item, list) and all(map(_is_int, item)))):
            raise APIError(f"input[{i}] must be a string or a list of token ids", 400, "input")
    return list(raw)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def routes(state: ServerState) -> list[Route]:
    async def embeddings(request: Request, pooling: bool = False) -> Response:
        engine = _pooling_engine(state)
        body = await state.read_json(request, EmbeddingRequest)
        model = state.response_model(body.model)
        if body.dimensions is not None:
            try:
                engine.model.pooler.check_dimensions(body.dimensions, engine.model.hidden_size)
            except ValueError as exc:
                raise APIError(str(exc), 400, "dimensions") from exc
        vectors, ids = await _run(
            request,
            "input",
            engine.embed_inputs(
                _items(body.input), body.add_special_tokens, body.truncate_prompt_tokens
            ),
        )
        if body.dimensions is not None:
            vectors = [v[: body.dimensions] for v in vectors]
            if engine.model.pooler.normalize:
                vectors = [F.normalize(v, dim=-1) for v in vectors]
        rid, created = f"embd-{state.new_request_id()}", int(time.time())
        encoded = [_encode_vector(v, body.encoding_format) for v in vectors]
        if pooling:
            data = [PoolingData(index=i, data=e) for i, e in enumerate(encoded)]
            return _json(PoolingResponse(rid, created, model, data, _usage(ids)))
        items = [EmbeddingData(index=i, embedding=e) for i, e in enumerate(encoded)]
        return _json(EmbeddingResponse(rid, created, model, items, _usage(ids)))

    async def pooling(request: Request) -> Response:
        return await embeddings(request, pooling=True)

    async def score(request: Request) -> Response:
        engine = _pooling_engine(state)
        body = await state.read_json(request, ScoreRequest)
        model = state.response_model(body.model)
        seconds = [body.text_2] if isinstance(body.text_2, str) else list(body.text_2)
        if isinstance(body.text_1, str):
            firsts = [body.text_1] * len(seconds)
        elif len(body.text_1) == 1:
            firsts = list(body.text_1) * len(seconds)
        elif len(body.text_1) == len(seconds):
            firsts = list(body.text_1)
        else:
            raise APIError("text_1 must be one text or as many texts as text_2", 400, "text_1")
        if not seconds:
            raise APIError("text_2 must not be empty", 400, "text_2")
        scores, tokens = await _run(
            request,
            "text_2",
            engine.score(firsts, seconds, body.truncate_prompt_tokens),
            ("text_1", "text_2"),
        )
        data = [ScoreData(index=i, score=s) for i, s in enumerate(scores)]
        usage = PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)
        return _json(
            ScoreResponse(f"score-{state.new_request_id()}", int(time.time()), model, data, usage)
        )

    async def rerank(request: Request) -> Response:
        engine = _pooling_engine(state)
        body = await state.read_json(request, RerankRequest)
        model = state.response_model(body.model)
        if not body.documents:
            raise APIError("documents must not be empty", 400, "documents")
        if body.top_n is not None and body.top_n < 0:
            raise APIError(f"top_n must be >= 0, got {body.top_n}", 400, "top_n")
        scores, tokens = await _run(
            request,
            "documents",
            engine.score(
                [body.query] * len(body.documents),
                body.documents,
                body.truncate_prompt_tokens,
                ("query", "documents"),
            ),
            ("query", "documents"),
        )
        order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
        if body.top_n:
            order = order[: body.top_n]
        results = [
            RerankResult(
                index=i,
                relevance_score=scores[i],
                document=RerankDocument(body.documents[i]) if body.return_documents else None,
            )
            for i in order
        ]
        return _json(
            RerankResponse(f"rerank-{state.new_request_id()}", model, RerankUsage(tokens), results)
        )

    return [
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/pooling", pooling, methods=["POST"]),
        Route("/score", score, methods=["POST"]),
        Route("/v1/score", score, methods=["POST"]),
        Route("/rerank", rerank, methods=["POST"]),
        Route("/v1/rerank", rerank, methods=["POST"]),
        Route("/v2/rerank", rerank, methods=["POST"]),
    ]
