"""Request admission: one request's output state and its n sample requests (each with its
own params), built after the request has been checked, and the token ids of its bad words."""

from __future__ import annotations

import copy
from collections.abc import Mapping

from asyncserve.core.request import Request
from asyncserve.lora.request import LoRARequest
from asyncserve.multimodal.inputs import MultiModalInputs
from asyncserve.output.output_processor import ParentState
from asyncserve.output.request_stream import RequestStream
from asyncserve.sampling_params import SamplingParams
from asyncserve.tokenizer import Tokenizer


def bad_words_token_ids(tokenizer: Tokenizer, words: list[str]) -> list[list[int]]:
    """Each bad word's token ids at the start of the text and after a space (where the
    tokenizer spells it with its own tokens), as vLLM rules them out."""
    out: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()  # a list lookup per word made many words quadratic
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            key = tuple(ids)
            if ids and key not in seen:
                seen.add(key)
                out.append(ids)
    return out


def child_params(params: SamplingParams, index: int, eos_token_ids: list[int]) -> SamplingParams:
    child = copy.copy(params)
    child.n = 1
    if index > 0:
        # The samples share one prompt: only the first computes its logprobs.
        child.prompt_logprobs = None
    if params.seed is not None:
        child.seed = params.seed + index
    # What stops the request (once min_tokens are out), and what min_tokens masks: the
    # request's stop ids and, unless ignore_eos, every EOS id of the model.
    child.all_stop_token_ids = set(params.stop_token_ids or [])
    if not params.ignore_eos:
        child.all_stop_token_ids |= set(eos_token_ids)
    return child


def build_request(
    request_id: str,
    prompt_text: str | None,
    prompt_ids: list[int],
    params: SamplingParams,
    priority: int,
    trace_headers: Mapping[str, str] | None,
    lora_request: LoRARequest | None,
    mm_inputs: MultiModalInputs | None,
    max_model_len: int,
    eos_token_ids: list[int],
) -> tuple[ParentState, list[Request]]:
    """The request's output state (with its stream) and its n sample requests."""
    room = max_model_len - len(prompt_ids)
    max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
    stream = RequestStream(request_id, params.output_kind)
    parent = ParentState(
        request_id=request_id,
        prompt=prompt_text,
        prompt_token_ids=prompt_ids,
        params=params,
        stream=stream,
        trace_headers=trace_headers,
    )
    requests = []
    for index in range(params.n):
        child_id = request_id if params.n == 1 else f"{request_id}#{index}"
        requests.append(
            Request(
                request_id=child_id,
                prompt_token_ids=prompt_ids,
                sampling_params=child_params(params, index, eos_token_ids),
                eos_token_id=eos_token_ids[0] if eos_token_ids else None,
                priority=priority,
                arrival_time=parent.arrival_time,
                max_tokens=max_tokens,
                lora_request=lora_request,
                mm_features=mm_inputs.features if mm_inputs is not None else None,
            )
        )
    return parent, requests
