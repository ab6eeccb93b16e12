"""The checks a request passes before it reaches a scheduler, shared by the engine and the
data-parallel front end (which rejects bad requests before choosing a replica)."""

from __future__ import annotations

import copy
import numbers

from asyncserve.core.grammar import StructuredOutputManager
from asyncserve.sampling_params import SamplingParams


def check_request(
    prompt_token_ids: list[int],
    params: SamplingParams,
    vocab_size: int,
    max_model_len: int,
    structured: StructuredOutputManager,
    strict_max_tokens: bool = True,
) -> None:
    """Raise ValueError when a request cannot run; the message names what is wrong."""
    n_prompt = len(prompt_token_ids)
    if n_prompt == 0:
        raise ValueError("prompt must not be empty")
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt contains token id {bad} outside the vocabulary [0, {vocab_size})")
    if n_prompt >= max_model_len:
        raise ValueError(
            f"prompt has {n_prompt} tokens but max_model_len is {max_model_len}: "
            "the prompt must be shorter than max_model_len"
        )
    check_token_params(params, vocab_size)
    if params.structured_outputs is not None:
        # Compiles the grammar (cached): a bad schema, regex or grammar names its field, and
        # allowed_token_ids that leave the grammar no first token name themselves.
        structured.validate(params.structured_outputs, params.allowed_token_ids)
    if strict_max_tokens and params.max_tokens is not None:
        total = n_prompt + params.max_tokens
        if total > max_model_len:
            raise ValueError(
                f"max_tokens: this model's maximum context length is {max_model_len} "
                f"tokens, but {total} were requested ({n_prompt} in the prompt, "
                f"{params.max_tokens} in the completion)"
            )
    check_min_tokens(n_prompt, params, max_model_len)


def check_min_tokens(n_prompt: int, params: SamplingParams, max_model_len: int) -> None:
    """min_tokens must fit in the room max_model_len leaves after the prompt, whether or not
    max_tokens is given: the output is capped there, short of min_tokens."""
    room = max_model_len - n_prompt
    if params.min_tokens <= room:
        return
    if params.max_tokens is None:
        # No max_tokens: that room is the limit, as a given max_tokens would be.
        limit = f"max_tokens ({room}: what"
    else:
        limit = f"{room} (what"
    raise ValueError(
        f"min_tokens must be <= {limit} max_model_len {max_model_len} leaves after the "
        f"{n_prompt}-token prompt), got {params.min_tokens}"
    )


def check_token_params(params: SamplingParams, vocab_size: int) -> None:
    """allowed_token_ids and logit_bias name only tokens of the vocabulary, and no more
    logprobs are asked for than it has (more would fail the whole step's top-k)."""
    _bound_logprobs(params, vocab_size, f"more than the vocabulary's {vocab_size} tokens")
    if params.allowed_token_ids is not None:
        bad = next((t for t in params.allowed_token_ids if t >= vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"allowed_token_ids contains token id {bad} outside the vocabulary [0, {vocab_size})"
            )
    if params.logit_bias:
        out_of_vocab = sorted(t for t in params.logit_bias if t >= vocab_size)
        if out_of_vocab:
            raise ValueError(
                f"logit_bias contains out-of-vocab token ids {out_of_vocab[:10]}; the "
                f"vocabulary size is {vocab_size}"
            )


def check_logprobs(params: SamplingParams, max_logprobs: int, vocab_size: int) -> None:
    """vLLM's bound on logprobs and prompt_logprobs: max_logprobs, -1 meaning no cap (the
    vocabulary). A request's -1 asks for the whole vocabulary, so counts as its size."""
    limit = vocab_size if max_logprobs == -1 else max_logprobs
    why = f"which is greater than max allowed: {limit} (LLM(max_logprobs=...))"
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value == -1 and vocab_size > limit:
            raise ValueError(
                f"{name}: requested -1 (the whole vocabulary, {vocab_size} tokens), {why}"
            )
    _bound_logprobs(params, limit, why)


def _bound_logprobs(params: SamplingParams, limit: int, why: str) -> None:
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > limit:
            raise ValueError(f"{name}: requested {value}, {why}")


def resolve_logprobs(params: SamplingParams, vocab_size: int) -> SamplingParams:
    """params with logprobs / prompt_logprobs of -1 (the whole vocabulary) made the
    vocabulary's size, the count the worker takes: a copy, the caller's are left as they
    are. params itself when neither is -1."""
    if params.logprobs != -1 and params.prompt_logprobs != -1:
        return params
    params = copy.copy(params)
    if params.logprobs == -1:
        params.logprobs = vocab_size
    if params.prompt_logprobs == -1:
        params.prompt_logprobs = vocab_size
    return params


def resolve_top_k(params: SamplingParams, vocab_size: int) -> SamplingParams:
    """params with a top_k of the vocabulary's size or more made 0 (no top-k), as vLLM
    treats it: keeping that many tokens keeps them all, and the worker's int64 column
    could not hold an arbitrarily large one. A copy; params itself when top_k is smaller."""
    if params.top_k < vocab_size:
        return params
    params = copy.copy(params)
    params.top_k = 0
    return params


def check_priority(priority: object) -> None:
    """The priority queue compares priorities when a request joins it: anything but an
    integer would fail there, with the request already half queued."""
    if not isinstance(priority, numbers.Integral) or isinstance(priority, bool):
        raise ValueError(f"priority must be an integer, got {priority!r}")


def check_truncation(keep: int, max_model_len: int) -> None:
    """vLLM refuses a truncate_prompt_tokens over max_model_len, whatever the prompt."""
    if keep > max_model_len:
        raise ValueError(
            f"truncate_prompt_tokens value ({keep}) is greater than max_model_len "
            f"({max_model_len}); select a smaller truncation size"
        )


def truncate_prompt(prompt_ids: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    """The last truncate_prompt_tokens prompt tokens (-1: what max_model_len leaves room
    for, one token kept for the output)."""
    keep = params.truncate_prompt_tokens
    if keep is None:
        return prompt_ids
    check_truncation(keep, max_model_len)
    if keep == -1:
        keep = max_model_len - 1
    return prompt_ids[-keep:]
