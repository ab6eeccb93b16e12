"""POST /v1/chat/completions/batch (vLLM): several conversations in one request, each
answered as one choice (index = the conversation's position), in one chat.completion."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from asyncserve.http.chat import prepare_chat_prompt
from asyncserve.http.chat_images import ChatImages, load_chat_images
from asyncserve.http.errors import APIError
from asyncserve.http.logprobs import chat_logprobs
from asyncserve.http.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatResponseMessage,
)
from asyncserve.http.sampling import chat_params
from asyncserve.http.serving import PromptInput, ServerState, engine_error, usage
from asyncserve.http.sse import cancel_on_disconnect, closing, merge_streams
from asyncserve.outputs import RequestOutput
from asyncserve.tracing import trace_headers

MAX_CONVERSATIONS = 1024


class BatchChatCompletionRequest(ChatCompletionRequest, kw_only=True):
    """A chat request whose `messages` is a list of conversations."""

    messages: list[list[ChatMessage]]  # type: ignore[assignment]


def _check(body: BatchChatCompletionRequest) -> None:
    # As vLLM: no streaming, tools or beam search in batch mode; one choice per conversation.
    for name, bad in (
        ("stream", body.stream),
        ("tools", bool(body.tools)),
        ("tool_choice", body.tool_choice not in (None, "none")),
        ("use_beam_search", body.use_beam_search),
        ("n", body.n != 1),
        # One response-level prompt_logprobs cannot hold several conversations'.
        ("prompt_logprobs", body.prompt_logprobs is not None),
    ):
        if bad:
            raise APIError(f"{name} is not supported by /v1/chat/completions/batch", 400, name)
    if not body.messages:
        raise APIError("messages must hold at least one conversation", 400, "messages")
    if len(body.messages) > MAX_CONVERSATIONS:
        raise APIError(
            f"at most {MAX_CONVERSATIONS} conversations per request, got {len(body.messages)}",
            400,
            "messages",
        )


@contextlib.contextmanager
def _naming(index: int) -> Iterator[None]:
    """400s about one conversation name it: messages[1] -> messages[2][1]."""
    try:
        yield
    except APIError as exc:
        exc.param = (exc.param or "messages").replace("messages", f"messages[{index}]", 1)
        raise


async def create_batch_chat_completion(state: ServerState, request: Request) -> Response:
    body = await state.read_json(request, BatchChatCompletionRequest)
    model = state.response_model(body.model)
    _check(body)
    body.top_logprobs = state.resolve_logprobs(body.top_logprobs, "top_logprobs")
    params = chat_params(body, state.generation_config)

    # Each conversation goes the single route's way: images fetched here, the rest in the
    # preprocessing pool.
    conversations = [msgspec.structs.replace(body, messages=c) for c in body.messages]
    images: list[ChatImages] = []
    for i, one in enumerate(conversations):
        with _naming(i):
            images.append(await load_chat_images(state.engine, one))

    def prepare() -> list[PromptInput]:
        prompts: list[PromptInput] = []
        for i, (one, its_images) in enumerate(zip(conversations, images, strict=True)):
            with _naming(i):
                prompts.append(prepare_chat_prompt(state, one, its_images, params))
        return prompts

    prompts = await state.preprocessor.run(prepare)
    ticket = state.check_ready(body.priority, len(prompts))
    request_id = f"chatcmpl-{state.base_request_id(request, body.request_id)}"
    engine_ids = [state.new_request_id() for _ in prompts]
    traced = trace_headers(request.headers)
    for rid, prompt in zip(engine_ids, prompts, strict=True):
        state.log_request(rid, prompt, params)
    lora = state.lora_for(body.model)
    streams = [
        ticket.watch(
            state.engine.generate(
                p.token_ids,
                params,
                rid,
                priority=body.priority,
                trace_headers=traced,
                lora_request=lora,
                **({"mm_inputs": p.mm_inputs} if p.mm_inputs else {}),
            )
        )
        for rid, p in zip(engine_ids, prompts, strict=True)
    ]

    async def collect() -> list[RequestOutput | None]:
        finals: list[RequestOutput | None] = [None] * len(prompts)
        async with closing(merge_streams(streams)) as merged:
            async for index, out in merged:
                finals[index] = out
        return finals

    finals = await cancel_on_disconnect(collect(), request.receive, request.scope)
    token_text = state.token_text_for(body.return_tokens_as_token_ids)
    choices: list[ChatChoice] = []
    completion_tokens = 0
    for i, out in enumerate(finals):
        if out is None:
            raise RuntimeError(f"the engine ended conversation {i} without an output")
        if out.error is not None and not out.internal_error:
            raise engine_error(out, state.engine)
        comp = out.outputs[0]
        completion_tokens += len(comp.token_ids)
        logprobs = None
        if body.logprobs:
            entries = comp.logprobs or [None] * len(comp.token_ids)  # type: ignore[list-item]
            logprobs = chat_logprobs(comp.token_ids, entries, token_text, body.top_logprobs or 0)
        choices.append(
            ChatChoice(
                index=i,
                message=ChatResponseMessage(role="assistant", content=comp.text),
                logprobs=logprobs,
                finish_reason=comp.finish_reason,
                stop_reason=comp.stop_reason,
                token_ids=list(comp.token_ids) if body.return_token_ids else None,
            )
        )
    outputs = [f for f in finals if f is not None]
    response = ChatCompletionResponse(
        id=request_id,
        object="chat.completion",
        created=int(time.time()),
        model=model,
        choices=choices,
        usage=usage(outputs, prompts, completion_tokens),
    )
    return Response(msgspec.json.encode(response), media_type="application/json")
