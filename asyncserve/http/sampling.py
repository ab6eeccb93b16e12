"""Request body -> SamplingParams, with the model's generation_config as the defaults.

A field the client left out (None) takes the model's default when generation_config has one,
as vLLM does; bad values come back as a 400 naming the request's field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from asyncserve.http.errors import APIError, from_value_error
from asyncserve.http.protocol import (
    MAX_N,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    SamplingFields,
)
from asyncserve.sampling_params import (
    MODEL_SAMPLING_DEFAULTS,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

# Fields whose default comes from the model's generation_config when the request omits them.
MODEL_DEFAULT_KEYS = MODEL_SAMPLING_DEFAULTS
_FALLBACKS: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def resolve_generation_config(option: str, model_defaults: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's --generation-config: "auto" takes the model's generation_config.json defaults,
    "vllm" none of them, a folder the defaults in its generation_config.json."""
    if option == "auto":
        return dict(model_defaults)
    if option == "vllm":
        return {}
    path = Path(option) / "generation_config.json"
    if not path.is_file():
        raise ValueError(
            f"--generation-config: {option!r} is not 'auto', 'vllm' or a folder holding a "
            "generation_config.json"
        )
    raw = json.loads(path.read_text())
    if not isinstance(raw, dict):
        raise ValueError(f"--generation-config: {path} does not hold a JSON object")
    keys = (*MODEL_DEFAULT_KEYS, "max_new_tokens")
    return {k: raw[k] for k in keys if raw.get(k) is not None}


def _resolve(
    name: str, value: Any, generation_config: Mapping[str, Any]
) -> Any:  # the request's value, else the model's default, else the OpenAI default
    if value is not None:
        return value
    if name in MODEL_DEFAULT_KEYS and generation_config.get(name) is not None:
        return generation_config[name]
    return _FALLBACKS[name]


def check_stream_fields(body: SamplingFields) -> None:
    """vLLM's stream rules: stream_options only with stream, no prompt logprobs in a stream."""
    if body.stream_options is not None and not body.stream:
        raise APIError("stream_options is only allowed with stream=true", 400, "stream_options")
    prompt_logprobs = body.prompt_logprobs
    if (
        body.stream
        and prompt_logprobs is not None
        and (prompt_logprobs > 0 or prompt_logprobs == -1)
    ):
        raise APIError(
            "`prompt_logprobs` are not available when `stream=True`.", 400, "prompt_logprobs"
        )


def _check_common(body: SamplingFields | GenerateRequest) -> None:
    for name in _FLOAT_FIELDS:
        value = getattr(body, name)
        if value is not None and not math.isfinite(value):
            raise APIError(f"{name} must be a finite number, got {value}", 400, name)
    if not 1 <= body.n <= MAX_N:
        raise APIError(f"n must be an integer in [1, {MAX_N}], got {body.n}", 400, "n")
    if isinstance(body, SamplingFields):
        check_stream_fields(body)
    # /generate takes best_of too: ignoring it would return n samples as if the best had
    # been picked from more.
    if body.best_of is not None and body.best_of != body.n and not body.use_beam_search:
        raise APIError(
            f"best_of must equal n ({body.n}) when given: best_of > n is not supported",
            400,
            "best_of",
        )


_GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _guided(body: SamplingFields) -> StructuredOutputsParams | None:
    """vLLM's older guided_* fields: each one is a structured_outputs constraint."""
    given = [name for name in _GUIDED_FIELDS if getattr(body, name) is not None]
    if not given:
        return None
    if len(given) > 1 or body.structured_outputs is not None or body.response_format is not None:
        others = given + [
            name for name in ("structured_outputs", "response_format") if getattr(body, name)
        ]
        raise APIError(f"give one output constraint, got {', '.join(others)}", 400, given[0])
    try:
        return StructuredOutputsParams(
            json=body.guided_json,
            regex=body.guided_regex,
            choice=body.guided_choice,
            grammar=body.guided_grammar,
        )
    except ValueError as exc:
        raise APIError(str(exc), 400, given[0]) from exc


def constraint_field(body: SamplingFields) -> str:
    """The request field the output constraint came from, for the 400s about it."""
    given = [name for name in _GUIDED_FIELDS if getattr(body, name) is not None]
    if given:
        return given[0]
    return "response_format" if body.response_format is not None else "structured_outputs"


def structured_outputs(body: SamplingFields) -> StructuredOutputsParams | None:
    """The request's output constraint: vLLM's structured_outputs (or its older guided_*
    fields) or OpenAI's response_format."""
    guided = _guided(body)
    if guided is not None:
        return guided
    fmt = body.response_format
    request = body.structured_outputs
    if fmt is not None and fmt.type != "text":
        if request is not None:
            raise APIError(
                "give either response_format or structured_outputs, not both",
                400,
                "response_format",
            )
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.type != "json_schema":
            raise APIError(
                f"response_format type must be text, json_object or json_schema, got {fmt.type!r}",
                400,
                "response_format",
            )
        schema = (fmt.json_schema or {}).get("schema")
        if not isinstance(schema, dict):
            raise APIError(
                "response_format of type json_schema needs json_schema.schema, a JSON object",
                400,
                "response_format",
            )
        return StructuredOutputsParams(json=schema)
    if request is None:
        return None
    try:
        return StructuredOutputsParams(
            json=request.json,
            regex=request.regex,
            choice=request.choice,
            grammar=request.grammar,
            json_object=request.json_object,
        )
    except ValueError as exc:
        raise APIError(str(exc), 400, "structured_outputs") from exc


def _build(
    fields: dict[str, Any],
    generation_config: Mapping[str, Any],
    renames: Mapping[str, str] | None = None,
) -> SamplingParams:
    for name in _FALLBACKS:
        if name in fields:
            fields[name] = _resolve(name, fields[name], generation_config)
    try:
        return SamplingParams(**fields)
    except ValueError as exc:
        raise from_value_error(exc, None, renames) from exc
    except TypeError as exc:  # a value of the wrong type that msgspec let through
        raise APIError(str(exc), 400) from exc


def _shared(body: SamplingFields, output_kind: RequestOutputKind) -> dict[str, Any]:
    return {
        "n": body.n,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "seed": body.seed,
        "min_tokens": body.min_tokens,
        "stop": body.stop,
        "stop_token_ids": body.stop_token_ids,
        "ignore_eos": body.ignore_eos,
        "include_stop_str_in_output": body.include_stop_str_in_output,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "repetition_penalty": body.repetition_penalty,
        "skip_special_tokens": body.skip_special_tokens,
        "spaces_between_special_tokens": body.spaces_between_special_tokens,
        "allowed_token_ids": body.allowed_token_ids,
        "bad_words": body.bad_words,
        "logit_bias": _logit_bias(body.logit_bias),
        "truncate_prompt_tokens": body.truncate_prompt_tokens,
        "kv_transfer_params": body.kv_transfer_params,
        "prompt_logprobs": body.prompt_logprobs,
        "output_kind": output_kind,
    }


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias keys are token ids as strings."""
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        digits = key.strip()
        # ASCII digits only: str.isdigit() alone also takes "²", which int() refuses.
        if not (digits.isascii() and digits.isdigit()):
            raise APIError(
                f"logit_bias keys must be token ids (non-negative integers), got {key!r}",
                400,
                "logit_bias",
            )
        out[int(digits)] = value
    return out


def completion_params(
    body: CompletionRequest, generation_config: Mapping[str, Any]
) -> SamplingParams:
    _check_common(body)
    fields = _shared(body, RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY)
    # echo with max_tokens 0 returns only the prompt (completions.py drops the one token
    # the engine generates), as vLLM does for scoring prompts.
    echo_only = body.echo and body.max_tokens == 0
    if echo_only and body.min_tokens > 0:  # checked here: the engine is asked for 1 token
        raise APIError(
            f"min_tokens must be <= max_tokens (0), got {body.min_tokens}", 400, "min_tokens"
        )
    fields["max_tokens"] = 1 if echo_only else body.max_tokens
    fields["logprobs"] = body.logprobs
    fields["detokenize"] = body.detokenize
    fields["structured_outputs"] = structured_outputs(body)
    prompt_logprobs = body.prompt_logprobs
    if body.echo and body.logprobs is not None and prompt_logprobs is None:
        prompt_logprobs = body.logprobs  # echo with logprobs reports the prompt's too
    fields["prompt_logprobs"] = prompt_logprobs
    return _build(fields, generation_config)


def chat_params(
    body: ChatCompletionRequest, generation_config: Mapping[str, Any]
) -> SamplingParams:
    _check_common(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError("top_logprobs requires logprobs to be true", 400, "top_logprobs")
    renames = {"logprobs": "top_logprobs"}
    max_tokens = body.max_completion_tokens
    if max_tokens is not None:
        renames["max_tokens"] = "max_completion_tokens"
    else:
        max_tokens = body.max_tokens
    if max_tokens is None:  # vLLM: generation_config's max_new_tokens is the default
        max_tokens = generation_config.get("max_new_tokens")
    fields = _shared(body, RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY)
    fields["max_tokens"] = max_tokens
    fields["logprobs"] = (body.top_logprobs or 0) if body.logprobs else None
    fields["structured_outputs"] = structured_outputs(body)
    return _build(fields, generation_config, renames)


def generate_params(body: GenerateRequest, generation_config: Mapping[str, Any]) -> SamplingParams:
    _check_common(body)
    fields = {
        "n": body.n,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "max_tokens": body.max_tokens,
        "stop": body.stop,
        "seed": body.seed,
        "ignore_eos": body.ignore_eos,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "repetition_penalty": body.repetition_penalty,
        "output_kind": (
            RequestOutputKind.CUMULATIVE if body.stream else RequestOutputKind.FINAL_ONLY
        ),
    }
    return _build(fields, generation_config)
