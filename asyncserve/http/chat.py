"""POST /v1/chat/completions: the model's chat template, n samples, streamed (SSE) or not."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from asyncserve.http.chat_images import ChatImages, load_chat_images
from asyncserve.http.chat_prompt import render_chat_prompt
from asyncserve.http.errors import APIError
from asyncserve.http.limits import Ticket
from asyncserve.http.logprobs import chat_logprobs, prompt_logprobs
from asyncserve.http.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    PerRequestMetrics,
    UsageInfo,
)
from asyncserve.http.sampling import chat_params, check_stream_fields, constraint_field
from asyncserve.http.serving import PromptInput, ServerState, engine_error, usage
from asyncserve.http.sse import (
    DONE,
    EventStreamResponse,
    cancel_on_disconnect,
    closing,
    sse_event,
)
from asyncserve.http.text_chunks import TextChunks
from asyncserve.http.tools.parsers import ParseResult
from asyncserve.http.tools.plan import ToolPlan, plan_tools, tool_calls
from asyncserve.http.tools.stream import ToolCallStream
from asyncserve.outputs import CompletionOutput, RequestOutput
from asyncserve.sampling_params import SamplingParams
from asyncserve.tracing import trace_headers

logger = logging.getLogger(__name__)


def _check_unsupported(body: ChatCompletionRequest) -> None:
    if body.use_beam_search:
        raise APIError(
            "use_beam_search is supported on /v1/completions and /generate",
            400,
            "use_beam_search",
        )


class _Job:
    def __init__(
        self,
        state: ServerState,
        body: ChatCompletionRequest,
        prompt: PromptInput,
        model: str,
        request: Request,
        tools: ToolPlan,
    ) -> None:
        self.state = state
        self.tools = tools
        self.body = body
        self.prompt = prompt
        self.model = model
        self.id = f"chatcmpl-{state.base_request_id(request, body.request_id)}"
        self.created = int(time.time())
        self.engine_id = state.new_request_id()
        self.token_text = state.token_text_for(body.return_tokens_as_token_ids)
        self.ticket: Ticket | None = None
        self.trace_headers = trace_headers(request.headers)

    def stream(self, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        assert self.ticket is not None
        self.state.log_request(self.engine_id, self.prompt, params)
        return self.ticket.watch(
            self.state.engine.generate(
                self.prompt.token_ids,
                params,
                self.engine_id,
                priority=self.body.priority,
                trace_headers=self.trace_headers,
                lora_request=self.state.lora_for(self.body.model),
                **({"mm_inputs": self.prompt.mm_inputs} if self.prompt.mm_inputs else {}),
            )
        )

    def logprobs(self, comp: CompletionOutput) -> ChatLogprobs | None:
        if not self.body.logprobs:
            return None
        entries = comp.logprobs or [None] * len(comp.token_ids)  # type: ignore[list-item]
        return chat_logprobs(comp.token_ids, entries, self.token_text, self.body.top_logprobs or 0)

    def chunk(
        self,
        choices: list[ChatStreamChoice],
        usage_info: UsageInfo | None = None,
        prompt_token_ids: list[int] | None = None,
        metrics: PerRequestMetrics | None = None,
    ) -> bytes:
        return sse_event(
            ChatCompletionStreamResponse(
                id=self.id,
                object="chat.completion.chunk",
                created=self.created,
                model=self.model,
                choices=choices,
                usage=usage_info,
                prompt_token_ids=prompt_token_ids,
                metrics=metrics,
            )
        )


async def create_chat_completion(state: ServerState, request: Request) -> Response:
    body = await state.read_json(request, ChatCompletionRequest)
    model = state.response_model(body.model)
    _check_unsupported(body)
    check_stream_fields(body)
    body.top_logprobs = state.resolve_logprobs(body.top_logprobs, "top_logprobs")
    body.prompt_logprobs = state.resolve_logprobs(body.prompt_logprobs, "prompt_logprobs", "prompt")
    params = chat_params(body, state.generation_config)
    tools = _plan_tools(state, body, params.structured_outputs is not None)
    tools.apply(params)
    constraint = "tools" if tools.forced else None
    images = await load_chat_images(state.engine, body)
    # In the preprocessing pool: off the event loop.
    prompt = await state.preprocessor.run(
        prepare_chat_prompt, state, body, images, params, constraint
    )
    job = _Job(state, body, prompt, model, request, tools)
    job.ticket = state.check_ready(body.priority)
    if body.stream:
        return EventStreamResponse(_stream(job, params))
    final = await cancel_on_disconnect(_final(job.stream(params)), request.receive, request.scope)
    if final.error is not None and not final.internal_error:
        raise engine_error(final, state.engine)
    choices = [_choice(job, comp) for comp in sorted(final.outputs, key=lambda c: c.index)]
    completion_tokens = sum(len(c.token_ids) for c in final.outputs)
    response = ChatCompletionResponse(
        id=job.id,
        object="chat.completion",
        created=job.created,
        model=model,
        choices=choices,
        usage=usage([final], [prompt], completion_tokens),
        prompt_logprobs=prompt_logprobs(final.prompt_logprobs)
        if job.body.prompt_logprobs is not None
        else None,
        prompt_token_ids=prompt.token_ids if body.return_token_ids else None,
        metrics=state.request_metrics(final, completion_tokens, body.n == 1),
        kv_transfer_params=final.kv_transfer_params,
    )
    return Response(msgspec.json.encode(response), media_type="application/json")


def prepare_chat_prompt(
    state: ServerState,
    body: ChatCompletionRequest,
    images: ChatImages,
    params: SamplingParams,
    constraint: str | None = None,
) -> PromptInput:
    """One conversation's prompt as the engine takes it: rendered with its images (from
    load_chat_images), tokenized, the images processed, checked; 400s name the field
    (`constraint`: the field the output constraint came from). Blocking: in the
    preprocessing pool. The batch route shares it, so both take the same messages."""
    text = render_chat_prompt(state.engine.tokenizer, body, state.config.chat_template, images)
    prompt = state.prepare(text, body.add_special_tokens, params)
    mm = images.process(prompt.token_ids)
    if mm is not None:
        prompt = PromptInput(prompt.text, mm.prompt_token_ids, mm)
    given = body.max_completion_tokens is not None
    max_tokens_param = "max_completion_tokens" if given else "max_tokens"
    constraint = constraint or constraint_field(body)
    state.validate(prompt, params, "messages", max_tokens_param, constraint)
    return prompt


def _plan_tools(state: ServerState, body: ChatCompletionRequest, constrained: bool) -> ToolPlan:
    config = state.config
    parser = config.tool_call_parser if config.enable_auto_tool_choice else None
    return plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, parser, constrained)


def _choice(job: _Job, comp: CompletionOutput) -> ChatChoice:
    parser = job.tools.new_parser()
    parsed = parser.extract(comp.text) if parser is not None else ParseResult(comp.text)
    calls = tool_calls(parsed)
    return ChatChoice(
        index=comp.index,
        message=ChatResponseMessage(
            role="assistant",
            # OpenAI's shape: no content (null) beside tool calls unless the model wrote some.
            content=parsed.content if parsed.content or not calls else None,
            tool_calls=calls,
        ),
        logprobs=job.logprobs(comp),
        finish_reason=job.tools.finish_reason(comp.finish_reason, bool(calls)),
        stop_reason=comp.stop_reason,
        token_ids=list(comp.token_ids) if job.body.return_token_ids else None,
    )


async def _final(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    final: RequestOutput | None = None
    async with closing(stream) as outputs:
        async for out in outputs:
            final = out
    if final is None:
        raise RuntimeError("the engine ended the request without an output")
    return final


async def _stream(job: _Job, params: SamplingParams) -> AsyncIterator[bytes]:
    include_usage, continuous = job.state.usage_flags(job.body.stream_options)
    return_ids = bool(job.body.return_token_ids)
    # Steps that only add text take the short way (TextChunks) unless something per token
    # (logprobs, token ids, running usage, tool parsing) goes into every chunk.
    text_only = not (job.body.logprobs or return_ids or continuous or job.tools.mode != "none")
    text_chunk = TextChunks(
        lambda i: job.chunk([ChatStreamChoice(index=i, delta=DeltaMessage(content=""))]),
        "content",
    )
    prompt_tokens = len(job.prompt.token_ids)
    tokens: dict[int, int] = {}  # completion tokens so far, per choice
    finished: set[int] = set()  # choices whose finish_reason went out: nothing more for them
    last: RequestOutput | None = None
    wants_logprobs = job.body.logprobs
    tool_streams: dict[int, ToolCallStream] = {}
    try:
        # The role comes first, one chunk per choice, before any token is generated.
        for index in range(job.body.n):
            role = DeltaMessage(role="assistant", content="")
            yield job.chunk(
                [ChatStreamChoice(index=index, delta=role)],
                _running(prompt_tokens, 0) if continuous else None,
                job.prompt.token_ids if return_ids else None,
            )
        failed = False
        async with closing(job.stream(params)) as outputs:
            async for out in outputs:
                last = out
                if out.error is not None:
                    yield sse_event(engine_error(out, job.state.engine).to_body())
                    failed = True
                    break
                for comp in out.outputs:
                    if comp.index in finished:
                        continue
                    tokens[comp.index] = tokens.get(comp.index, 0) + len(comp.token_ids)
                    if text_only and comp.finish_reason is None and comp.stop_reason is None:
                        if comp.text:
                            yield text_chunk(comp.index, comp.text)
                        continue
                    deltas = _deltas(job, tool_streams, comp)
                    if (
                        deltas == [DeltaMessage()]
                        and comp.finish_reason is None
                        and not (comp.token_ids and (wants_logprobs or return_ids))
                    ):
                        continue
                    if comp.finish_reason is not None:
                        finished.add(comp.index)
                    called = comp.index in tool_streams and tool_streams[comp.index].called
                    running = _running(prompt_tokens, tokens[comp.index]) if continuous else None
                    # Tool-call headers and fragments go out one per chunk; the last chunk
                    # carries the step's logprobs, token ids and finish reason.
                    for delta in deltas[:-1]:
                        yield job.chunk([ChatStreamChoice(index=comp.index, delta=delta)], running)
                    choice = ChatStreamChoice(
                        index=comp.index,
                        delta=deltas[-1],
                        logprobs=job.logprobs(comp),
                        finish_reason=job.tools.finish_reason(comp.finish_reason, called),
                        stop_reason=comp.stop_reason,
                    )
                    if return_ids:
                        choice.token_ids = list(comp.token_ids)
                    yield job.chunk([choice], running)
        if include_usage and not failed:
            completion_tokens = sum(tokens.values())
            outputs_seen = [last] if last is not None else []
            metrics = job.state.request_metrics(last, completion_tokens, job.body.n == 1)
            yield job.chunk(
                [], usage(outputs_seen, [job.prompt], completion_tokens), metrics=metrics
            )
    except Exception as exc:  # never a broken stream without a word: an error event, then DONE
        logger.exception("chat stream %s failed", job.id)
        yield sse_event(APIError(f"{type(exc).__name__}: {exc}", 500).to_body())
    yield DONE


def _deltas(
    job: _Job, streams: dict[int, ToolCallStream], comp: CompletionOutput
) -> list[DeltaMessage]:
    """The messages one engine output becomes (at least one, possibly empty): its text, or
    with tool parsing the new content and tool-call deltas."""
    if job.tools.mode == "none":
        return [DeltaMessage(content=comp.text) if comp.text else DeltaMessage()]
    stream = streams.get(comp.index)
    if stream is None:
        parser = job.tools.new_parser()
        assert parser is not None
        stream = streams[comp.index] = ToolCallStream(parser)
    content, calls = stream.feed(comp.text, comp.finish_reason is not None)
    out = [DeltaMessage(content=content)] if content else []
    out += [DeltaMessage(tool_calls=[call]) for call in calls]
    return out or [DeltaMessage()]


def _running(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    """vLLM's per-chunk usage: the prompt and this choice's tokens so far."""
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )
