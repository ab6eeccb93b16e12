"""The OpenAI routes: /v1/completions, /v1/chat/completions (and vLLM's .../batch),
/v1/models, and vLLM's /invocations (SageMaker's entry point, routed by the body)."""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Message

from asyncserve.http.chat import create_chat_completion
from asyncserve.http.chat_batch import create_batch_chat_completion
from asyncserve.http.completions import create_completion
from asyncserve.http.errors import APIError
from asyncserve.http.protocol import ModelCard, ModelList
from asyncserve.http.routes_lora import lora_cards
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
    return ModelList(object="list", data=cards + lora_cards(state))


async def invocations(state: ServerState, request: Request) -> Response:
    """vLLM's /invocations: a body with `messages` is a chat completion, one with `prompt`
    a completion."""
    raw = await state.read_json(request, msgspec.Raw)
    try:
        keys = msgspec.json.decode(raw, type=dict[str, msgspec.Raw])
    except msgspec.ValidationError as exc:
        raise APIError("the request body must be a JSON object", 400) from exc
    if "messages" in keys:
        handler = create_chat_completion
    elif "prompt" in keys:
        handler = create_completion
    else:
        raise APIError(
            "Cannot find suitable handler for request: expected a chat completion "
            "(`messages`) or a completion (`prompt`) body",
            400,
        )
    return await handler(state, _replay(request, bytes(raw)))


def _replay(request: Request, body: bytes) -> Request:
    """A request whose body, already read, is read again by the handler; disconnects still
    reach it through the original receive."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await request.receive()

    return Request(request.scope, receive)


def routes(state: ServerState) -> list[Route]:
    async def completions(request: Request) -> Response:
        return await create_completion(state, request)

    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(state, request)

    async def chat_batch(request: Request) -> Response:
        return await create_batch_chat_completion(state, request)

    async def invoke(request: Request) -> Response:
        return await invocations(state, request)

    async def models(request: Request) -> Response:
        return Response(msgspec.json.encode(model_list(state)), media_type="application/json")

    return [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/chat/completions/batch", chat_batch, methods=["POST"]),
        Route("/invocations", invoke, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
    ]
