"""The OpenAI routes: /v1/completions, /v1/chat/completions, /v1/models."""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from asyncserve.http.chat import create_chat_completion
from asyncserve.http.completions import create_completion
from asyncserve.http.protocol import ModelCard, ModelList
from asyncserve.http.serving import ServerState


def model_list(state: ServerState) -> ModelList:
    root = state.engine.model_path
    cards = [
        ModelCard(
            id=name,
            object="model",
            created=state.created,
            owned_by="asyncserve",
            root=root,
            max_model_len=state.engine.max_model_len,
        )
        for name in state.model_names
    ]
    return ModelList(object="list", data=cards)


def routes(state: ServerState) -> list[Route]:
    async def completions(request: Request) -> Response:
        return await create_completion(state, request)

    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(state, request)

    async def models(request: Request) -> Response:
        return Response(msgspec.json.encode(model_list(state)), media_type="application/json")

    return [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
    ]
