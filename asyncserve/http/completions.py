"""POST /v1/completions: one or many prompts, n samples each, streamed (SSE) or not."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from asyncserve.http.beam import beam_completion
from asyncserve.http.errors import APIError
from asyncserve.http.limits import Ticket
from asyncserve.http.logprobs import completion_logprobs, prompt_logprobs
from asyncserve.http.protocol import (
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamChoice,
    CompletionStreamResponse,
    PerRequestMetrics,
    UsageInfo,
)
from asyncserve.http.sampling import check_stream_fields, completion_params, constraint_field
from asyncserve.http.serving import (
    PromptInput,
    ServerState,
    engine_error,
    parse_prompts,
    usage,
)
from asyncserve.http.sse import (
    DONE,
    EventStreamResponse,
    cancel_on_disconnect,
    closing,
    merge_streams,
    sse_event,
)
from asyncserve.http.text_chunks import TextChunks
from asyncserve.outputs import CompletionOutput, RequestOutput
from asyncserve.sampling_params import SamplingParams
from asyncserve.tracing import trace_headers

logger = logging.getLogger(__name__)
MAX_CHOICES = 2048  # prompts x n in one request


class _Job:
    """One completions request after validation: its prompts, params and engine ids."""

    def __init__(
        self,
        state: ServerState,
        body: CompletionRequest,
        prompts: list[PromptInput],
        request: Request,
        ticket: Ticket,
    ) -> None:
        self.state = state
        self.body = body
        self.prompts = prompts
        self.ticket = ticket
        self.id = f"cmpl-{state.base_request_id(request, body.request_id)}"
        self.created = int(time.time())
        self.engine_ids = [state.new_request_id() for _ in prompts]
        self.token_text = state.token_text_for(body.return_tokens_as_token_ids)
        self.trace_headers = trace_headers(request.headers)

    def streams(self, params: SamplingParams) -> list[AsyncIterator[RequestOutput]]:
        engine = self.state.engine
        for rid, prompt in zip(self.engine_ids, self.prompts, strict=True):
            self.state.log_request(rid, prompt, params)
        lora = self.state.lora_for(self.body.model)
        return [
            self.ticket.watch(
                engine.generate(
                    p.token_ids,
                    params,
                    rid,
                    priority=self.body.priority,
                    trace_headers=self.trace_headers,
                    lora_request=lora,
                )
            )
            for rid, p in zip(self.engine_ids, self.prompts, strict=True)
        ]

    def chunk(
        self,
        model: str,
        choices: list[CompletionStreamChoice],
        usage_info: UsageInfo | None,
        metrics: PerRequestMetrics | None = None,
    ) -> bytes:
        return sse_event(
            CompletionStreamResponse(
                id=self.id,
                object="text_completion",
                created=self.created,
                model=model,
                choices=choices,
                usage=usage_info,
                metrics=metrics,
            )
        )

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0 (vLLM's, and OpenAI's, for scoring a prompt): the prompt
        comes back, with its logprobs if asked, and nothing generated."""
        return bool(self.body.echo) and self.body.max_tokens == 0

    def shown(self, comp: CompletionOutput) -> CompletionOutput:
        """The choice as the response shows it: without the one token an echo-only request
        generates (the engine runs at least one)."""
        if not self.echo_only:
            return comp
        return dataclasses.replace(
            comp, text="", token_ids=[], logprobs=[] if comp.logprobs is not None else None
        )

    def echo_prefix(self, prompt_index: int) -> str:
        """The prompt text an echoed choice starts with; none with return_token_ids, where
        the prompt comes back as prompt_token_ids instead (as vLLM does)."""
        if not self.body.echo or self.body.return_token_ids:
            return ""
        return self.state.prompt_text(self.prompts[prompt_index])

    def logprobs(
        self, prompt_index: int, out: RequestOutput, comp: CompletionOutput, offset: int, echo: bool
    ) -> CompletionLogprobs | None:
        if self.body.logprobs is None:
            return None
        token_text = self.token_text
        ids = comp.token_ids
        entries = comp.logprobs or [None] * len(ids)  # type: ignore[list-item]
        if not echo:
            return completion_logprobs(ids, entries, token_text, offset)
        prompt = self.prompts[prompt_index]
        prompt_entries = out.prompt_logprobs or [None] * len(prompt.token_ids)
        head = completion_logprobs(prompt.token_ids, prompt_entries, token_text, offset)
        tail = completion_logprobs(
            ids, entries, token_text, offset + len(self.state.prompt_text(prompt))
        )
        return CompletionLogprobs(
            tokens=head.tokens + tail.tokens,
            token_logprobs=head.token_logprobs + tail.token_logprobs,
            top_logprobs=head.top_logprobs + tail.top_logprobs,
            text_offset=head.text_offset + tail.text_offset,
        )


async def create_completion(state: ServerState, request: Request) -> Response:
    body = await state.read_json(request, CompletionRequest)
    model = state.response_model(body.model)
    if body.suffix:
        raise APIError("suffix is not supported", 400, "suffix")
    check_stream_fields(body)
    body.logprobs = state.resolve_logprobs(body.logprobs, "logprobs")
    body.prompt_logprobs = state.resolve_logprobs(body.prompt_logprobs, "prompt_logprobs", "prompt")
    params = completion_params(body, state.generation_config)
    raw_prompts = parse_prompts(body.prompt)
    if len(raw_prompts) * body.n > MAX_CHOICES:
        raise APIError(
            f"at most {MAX_CHOICES} choices (prompts x n) per request, got "
            f"{len(raw_prompts)} x {body.n}",
            400,
            "prompt",
        )

    def prepare() -> list[PromptInput]:  # in the preprocessing pool: off the event loop
        prompts = [state.prepare(p, body.add_special_tokens, params) for p in raw_prompts]
        for prompt in prompts:
            state.validate(prompt, params, "prompt", structured_param=constraint_field(body))
        return prompts

    prompts = await state.preprocessor.run(prepare)
    ticket = state.check_ready(body.priority, len(prompts))
    if body.use_beam_search:
        ticket.release(len(prompts))  # beam search runs its own requests
        return await beam_completion(state, body, prompts, model, request)
    job = _Job(state, body, prompts, request, ticket)
    if body.stream:
        return EventStreamResponse(_stream(job, params, model))
    return await _complete(job, params, model, request)


async def _complete(job: _Job, params: SamplingParams, model: str, request: Request) -> Response:
    async def collect() -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(job.prompts)
        async with closing(merge_streams(job.streams(params))) as merged:
            async for index, out in merged:
                finals[index] = out
        return [f for f in finals if f is not None]

    finals = await cancel_on_disconnect(collect(), request.receive, request.scope)
    body = job.body
    token_ids = bool(body.return_token_ids)
    choices: list[CompletionResponseChoice] = []
    completion_tokens = 0
    for i, out in enumerate(finals):
        if out.error is not None and not out.internal_error:
            raise engine_error(out, job.state.engine)
        prefix = job.echo_prefix(i)
        for comp in sorted(map(job.shown, out.outputs), key=lambda c: c.index):
            completion_tokens += len(comp.token_ids)
            choices.append(
                CompletionResponseChoice(
                    index=i * body.n + comp.index,
                    text=prefix + comp.text,
                    logprobs=job.logprobs(i, out, comp, 0, body.echo),
                    finish_reason=comp.finish_reason,
                    stop_reason=comp.stop_reason,
                    prompt_logprobs=prompt_logprobs(out.prompt_logprobs)
                    if body.prompt_logprobs is not None
                    else None,
                    token_ids=list(comp.token_ids) if token_ids else None,
                    prompt_token_ids=job.prompts[i].token_ids if token_ids else None,
                )
            )
    single = len(finals) == 1 and body.n == 1
    response = CompletionResponse(
        id=job.id,
        object="text_completion",
        created=job.created,
        model=model,
        choices=choices,
        usage=usage(finals, job.prompts, completion_tokens),
        metrics=job.state.request_metrics(finals[0] if finals else None, completion_tokens, single),
        kv_transfer_params=finals[0].kv_transfer_params if single else None,
    )
    return _json(response)


async def _stream(job: _Job, params: SamplingParams, model: str) -> AsyncIterator[bytes]:
    body = job.body
    n = body.n
    include_usage, continuous = job.state.usage_flags(body.stream_options)
    return_ids = bool(body.return_token_ids)
    echoed: set[int] = set()
    ids_sent: set[int] = set()  # choices whose prompt_token_ids went out (their first chunk)
    finished: set[int] = set()  # choices whose finish_reason went out: nothing more for them
    text_len: dict[int, int] = {}
    tokens: dict[int, int] = {}  # completion tokens so far, per choice
    last: dict[int, RequestOutput] = {}
    wants_logprobs = body.logprobs is not None
    # Steps that only add text take the short way unless something per token (logprobs,
    # token ids, running usage) goes into every chunk; an echoed first chunk does not.
    text_only = not (wants_logprobs or return_ids or continuous)
    text_chunk = TextChunks(
        lambda i: job.chunk(model, [CompletionStreamChoice(i, "", None, None)], None), "text"
    )
    try:
        failed = False
        async with closing(merge_streams(job.streams(params))) as merged:
            async for i, out in merged:
                last[i] = out
                if out.error is not None:
                    yield sse_event(engine_error(out, job.state.engine).to_body())
                    failed = True
                    break
                for comp in map(job.shown, out.outputs):
                    index = i * n + comp.index
                    if index in finished:
                        continue
                    tokens[index] = tokens.get(index, 0) + len(comp.token_ids)
                    echo = body.echo and index not in echoed
                    text = comp.text
                    plain = comp.finish_reason is None and comp.stop_reason is None
                    if text_only and plain and not echo:
                        text_len[index] = text_len.get(index, 0) + len(text)
                        if text:
                            yield text_chunk(index, text)
                        continue
                    if echo:
                        echoed.add(index)
                        text = job.echo_prefix(i) + text
                    offset = text_len.get(index, 0)
                    text_len[index] = offset + len(text)
                    logprobs = job.logprobs(i, out, comp, offset, echo)
                    if (
                        not text
                        and comp.finish_reason is None
                        and not (comp.token_ids and (wants_logprobs or return_ids))
                    ):
                        continue
                    if comp.finish_reason is not None:
                        finished.add(index)
                    choice = CompletionStreamChoice(
                        index=index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=comp.finish_reason,
                        stop_reason=comp.stop_reason,
                    )
                    if return_ids:
                        choice.token_ids = list(comp.token_ids)
                        if index not in ids_sent:
                            ids_sent.add(index)
                            choice.prompt_token_ids = job.prompts[i].token_ids
                    running = None
                    if continuous:  # vLLM's: this prompt's tokens and this choice's so far
                        prompt_tokens = len(job.prompts[i].token_ids)
                        running = UsageInfo(
                            prompt_tokens=prompt_tokens,
                            completion_tokens=tokens[index],
                            total_tokens=prompt_tokens + tokens[index],
                        )
                    yield job.chunk(model, [choice], running)
        if include_usage and not failed:
            completion_tokens = sum(tokens.values())
            final_usage = usage(list(last.values()), job.prompts, completion_tokens)
            single = len(job.prompts) == 1 and n == 1
            metrics = job.state.request_metrics(last.get(0), completion_tokens, single)
            yield job.chunk(model, [], final_usage, metrics)
    except Exception as exc:  # never a broken stream without a word: an error event, then DONE
        logger.exception("completion stream %s failed", job.id)
        yield sse_event(APIError(f"{type(exc).__name__}: {exc}", 500).to_body())
    yield DONE


def _json(payload: object) -> Response:
    return Response(msgspec.json.encode(payload), media_type="application/json")
