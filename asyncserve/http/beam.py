"""use_beam_search on /v1/completions and /generate (vLLM's extra field).

best_of (or n when best_of is absent) is the beam width; the best n beams of each prompt are
its choices, best first, each with the output text only (the final EOS left out), as vLLM's
server returns beam search. Not streamed: the whole search runs before the reply.
"""

from __future__ import annotations

import time
from typing import cast

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from asyncserve.beam_search import BeamEngine, BeamSearchParams, beam_search, to_request_output
from asyncserve.http.errors import APIError, from_value_error
from asyncserve.http.protocol import (
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    GenerateRequest,
)
from asyncserve.http.sampling import constraint_field, structured_outputs
from asyncserve.http.serving import PromptInput, ServerState, usage
from asyncserve.http.sse import cancel_on_disconnect
from asyncserve.outputs import RequestOutput


def beam_params(
    body: CompletionRequest | GenerateRequest, max_model_len: int
) -> tuple[BeamSearchParams, int]:
    """(BeamSearchParams, n) for a request with use_beam_search; 400 naming the field."""
    if body.stream:
        raise APIError("use_beam_search does not support stream", 400, "stream")
    if isinstance(body, CompletionRequest):
        _check_unsupported(body)
    elif body.stop:
        raise APIError("use_beam_search does not support stop", 400, "stop")
    width_param = "best_of" if body.best_of is not None else "n"
    width = body.best_of if body.best_of is not None else body.n
    if width < body.n:
        raise APIError(f"best_of must be >= n ({body.n}), got {width}", 400, "best_of")
    try:
        params = BeamSearchParams(
            beam_width=width,
            max_tokens=body.max_tokens if body.max_tokens is not None else max_model_len,
            ignore_eos=body.ignore_eos,
            temperature=body.temperature if body.temperature is not None else 0.0,
            length_penalty=body.length_penalty,
        )
    except ValueError as exc:
        raise from_value_error(exc, "use_beam_search", {"beam_width": width_param}) from exc
    return params, body.n


# Fields the search does not apply: refused, not silently ignored.
_UNSUPPORTED = (
    "logprobs",
    "prompt_logprobs",
    "stop",
    "stop_token_ids",
    "bad_words",
    "allowed_token_ids",
    "logit_bias",
)


def _check_unsupported(body: CompletionRequest) -> None:
    for name in _UNSUPPORTED:
        value = getattr(body, name)
        if value is not None and value != [] and value != {}:
            raise APIError(f"use_beam_search does not support {name}", 400, name)
    if body.min_tokens > 0:
        raise APIError("use_beam_search does not support min_tokens", 400, "min_tokens")
    if structured_outputs(body) is not None:
        param = constraint_field(body)
        raise APIError("use_beam_search does not support structured outputs", 400, param)


async def run_beam_search(
    state: ServerState,
    prompts: list[PromptInput],
    params: BeamSearchParams,
    n: int,
    request: Request,
) -> list[RequestOutput]:
    """One RequestOutput (n completions) per prompt; a client disconnect aborts the search."""
    if not hasattr(state.engine, "eos_token_ids"):
        raise APIError("this engine does not support beam search", 400, "use_beam_search")
    engine = cast(BeamEngine, state.engine)
    request_id = state.new_request_id()

    async def run() -> list[RequestOutput]:
        outputs = await beam_search(engine, [p.token_ids for p in prompts], params, request_id)
        return [
            to_request_output(engine, f"{request_id}-{i}", p.text, p.token_ids, out, n)
            for i, (p, out) in enumerate(zip(prompts, outputs, strict=True))
        ]

    return await cancel_on_disconnect(run(), request.receive, request.scope)


async def beam_completion(
    state: ServerState,
    body: CompletionRequest,
    prompts: list[PromptInput],
    model: str,
    request: Request,
) -> Response:
    params, n = beam_params(body, state.engine.max_model_len)
    finals = await run_beam_search(state, prompts, params, n, request)
    choices = []
    completion_tokens = 0
    for i, out in enumerate(finals):
        prefix = state.prompt_text(prompts[i]) if body.echo else ""
        for comp in out.outputs:
            completion_tokens += len(comp.token_ids)
            choices.append(
                CompletionResponseChoice(
                    index=i * n + comp.index,
                    text=prefix + comp.text,
                    logprobs=None,
                    finish_reason=comp.finish_reason,
                )
            )
    response = CompletionResponse(
        id=f"cmpl-{body.request_id or state.new_request_id()}",
        object="text_completion",
        created=int(time.time()),
        model=model,
        choices=choices,
        usage=usage(finals, prompts, completion_tokens),
    )
    return Response(msgspec.json.encode(response), media_type="application/json")
