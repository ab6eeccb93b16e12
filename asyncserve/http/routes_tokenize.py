"""vLLM's POST /tokenize (a prompt, or chat messages through the chat template) and
POST /detokenize, with vLLM's request and response shapes."""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from asyncserve.http.chat_images import ChatImages, load_chat_images
from asyncserve.http.chat_prompt import render_chat_prompt
from asyncserve.http.errors import APIError
from asyncserve.http.limits import check_prompt_chars
from asyncserve.http.protocol import ChatCompletionRequest, ChatMessage, Int64
from asyncserve.http.serving import ServerState
from asyncserve.http.tools.protocol import ChatTool


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Either `prompt` (vLLM's TokenizeCompletionRequest) or `messages` (TokenizeChatRequest)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # Default: true for a prompt, false for messages (the template adds them), as vLLM.
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    return_token_strs: bool = False


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    tokens: list[Int64]


class DetokenizeResponse(msgspec.Struct):
    prompt: str


def _chat_request(body: TokenizeRequest) -> ChatCompletionRequest:
    assert body.messages is not None
    return ChatCompletionRequest(
        messages=body.messages,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        chat_template_kwargs=body.chat_template_kwargs,
        tools=body.tools,
    )


def _prompt_ids(state: ServerState, body: TokenizeRequest, images: ChatImages | None) -> list[int]:
    """The prompt's token ids as the engine would see them (image placeholders expanded)."""
    tokenizer = state.engine.tokenizer
    if body.prompt is not None:
        check_prompt_chars(body.prompt, state.engine.max_model_len)
        add = True if body.add_special_tokens is None else body.add_special_tokens
        return list(tokenizer.encode(body.prompt, add_special_tokens=add))
    chat = _chat_request(body)
    text = render_chat_prompt(tokenizer, chat, state.config.chat_template, images)
    ids = list(tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens)))
    mm = images.process(ids) if images is not None else None
    return ids if mm is None else mm.prompt_token_ids


async def tokenize(state: ServerState, request: Request) -> Response:
    body = await state.read_json(request, TokenizeRequest)
    state.response_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError("give exactly one of prompt and messages", 400, "prompt")
    # Chat image parts are loaded (and counted against the limits) as for a chat request.
    images = None
    if body.messages is not None:
        images = await load_chat_images(state.engine, _chat_request(body))

    def run() -> TokenizeResponse:  # in the preprocessing pool: off the event loop
        ids = _prompt_ids(state, body, images)
        tokenizer = state.engine.tokenizer
        strs = list(tokenizer.convert_ids_to_tokens(ids)) if body.return_token_strs else None
        return TokenizeResponse(len(ids), state.engine.max_model_len, ids, strs)

    result = await state.preprocessor.run(run)
    return Response(msgspec.json.encode(result), media_type="application/json")


async def detokenize(state: ServerState, request: Request) -> Response:
    body = await state.read_json(request, DetokenizeRequest)
    state.response_model(body.model)
    vocab = state.vocab_size()
    bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(
            f"token id {body.tokens[bad]} is outside the vocabulary [0, {vocab})",
            400,
            f"tokens[{bad}]",
        )
    # Special tokens stay, as vLLM's (Hugging Face's default): /tokenize's chat prompt
    # comes back as the template's text.
    tokenizer = state.engine.tokenizer
    text = await state.preprocessor.run(lambda: tokenizer.decode(body.tokens, False))
    return Response(msgspec.json.encode(DetokenizeResponse(text)), media_type="application/json")


def routes(state: ServerState) -> list[Route]:
    async def tokenize_route(request: Request) -> Response:
        return await tokenize(state, request)

    async def detokenize_route(request: Request) -> Response:
        return await detokenize(state, request)

    return [
        Route("/tokenize", tokenize_route, methods=["POST"]),
        Route("/detokenize", detokenize_route, methods=["POST"]),
    ]
