"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

Handlers raise APIError; the app turns it (and Starlette's HTTP errors, and anything
unexpected) into a JSON response. Helpers map msgspec validation errors and SamplingParams'
ValueErrors ("<field> must be ...") to the request field they are about.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import msgspec
from starlette.responses import Response

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class ErrorInfo(msgspec.Struct, omit_defaults=False):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


class APIError(Exception):
    """An error the client should see, with its HTTP status and (when known) the field."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: int | str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code if code is not None else status
        self.headers = dict(headers or {})

    def to_body(self) -> ErrorResponse:
        return ErrorResponse(
            ErrorInfo(
                message=self.message,
                type=_TYPES.get(self.status, "APIError"),
                param=self.param,
                code=self.code,
            )
        )

    def response(self) -> Response:
        return Response(
            msgspec.json.encode(self.to_body()),
            status_code=self.status,
            media_type="application/json",
            headers=self.headers,
        )


def error_response(
    status: int, message: str, param: str | None = None, headers: Mapping[str, str] | None = None
) -> Response:
    return APIError(message, status, param, headers=headers).response()


# msgspec: "Expected `float`, got `str` - at `$.temperature`"
_AT_PATH = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_MISSING = re.compile(r"missing required field `(?P<field>[^`]+)`")
_UNKNOWN = re.compile(r"unknown field `(?P<field>[^`]+)`")


def param_from_path(path: str) -> str | None:
    """`.messages[0].role` -> `messages[0].role`; the root -> None."""
    path = path.removeprefix(".")
    return path or None


# A \uD800-\uDBFF escape not followed by a \uDC00-\uDFFF one, or one of those not preceded
# by the first kind: JSON text for a str that is not valid Unicode.
_LONE_SURROGATE = re.compile(
    rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
    rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}"
)


def from_validation_error(
    exc: msgspec.ValidationError | msgspec.DecodeError, body: bytes = b""
) -> APIError:
    """A 400 naming the field msgspec rejected; `body`, the request's, explains a lone
    surrogate escape (msgspec's own message for one can read "Input data was truncated")."""
    text = str(exc)
    if not isinstance(exc, msgspec.ValidationError):
        lone = _LONE_SURROGATE.search(body)
        if lone is not None:
            text = (
                f"the escape {lone.group().decode()} at byte {lone.start()} is a lone UTF-16 "
                "surrogate, not valid Unicode (a surrogate escape must be half of a pair)"
            )
        return APIError(f"Invalid JSON in the request body: {text}", 400)
    match = _AT_PATH.search(text)
    path = match.group("path") if match else ""
    message = text[: match.start()] if match else text
    param = param_from_path(path)
    named = _MISSING.search(message) or _UNKNOWN.search(message)
    if named is not None:
        field = named.group("field")
        param = f"{param}.{field}" if param else field
    if _UNKNOWN.search(message) is not None:
        return APIError(
            f"{param} is not a supported field: asyncserve does not implement it, so it "
            "would have no effect",
            400,
            param,
        )
    where = f" (at `{param}`)" if param else ""
    return APIError(f"{message}{where}{constraint_tag(message)}", 400, param)


def from_value_error(
    exc: ValueError, default_param: str | None, renames: Mapping[str, str] | None = None
) -> APIError:
    """A 400 for a ValueError whose message starts with the field name, as SamplingParams'."""
    message = str(exc) or type(exc).__name__
    first = message.split(" ", 1)[0].rstrip(":,")
    renames = renames or {}
    if first not in renames and first not in _KNOWN_FIELDS:
        first = first.split(".", 1)[0]  # "structured_outputs.json: ..." names structured_outputs
    if first in renames:
        param: str | None = renames[first]
    elif first in _KNOWN_FIELDS:
        param = first
    else:
        param = default_param
    for name, sent in renames.items():
        if name in _KNOWN_FIELDS and name != sent:
            # The field as the client sent it ("max_completion_tokens must be >= 1"); a
            # dotted name such as "structured_outputs.json" is a path, and stays.
            message = re.sub(rf"(?<![\w.]){name}(?![\w.])", sent, message)
    return APIError(message + constraint_tag(message), 400, param)


# msgspec's "Expected `int` >= 1", SamplingParams' "must be >= 0, got -1" and
# "must be in (0, 1], got 2": the bound, and for ranges the value.
_BOUND = re.compile(r"(>=|<=|>|<) ?-?\d")
_RANGE = re.compile(
    r"in (?P<lo_b>[\[(])(?P<lo>[-\d.e]+), (?P<hi>[-\d.e]+)(?P<hi_b>[\])]), got (?P<v>[-\d.e]+)"
)
_NAMES = {
    ">=": "greater_than_equal",
    "<=": "less_than_equal",
    ">": "greater_than",
    "<": "less_than",
}


def constraint_tag(message: str) -> str:
    """Pydantic's name for the violated bound, as vLLM's 400s carry it (clients match on
    "greater_than_equal" and the like): " [type=greater_than_equal]", or "" when none."""
    found = _RANGE.search(message)
    if found is not None:
        try:
            value, lo, hi = (float(found.group(k)) for k in ("v", "lo", "hi"))
        except ValueError:
            return ""
        if value < lo or (value == lo and found.group("lo_b") == "("):
            op = ">=" if found.group("lo_b") == "[" else ">"
        elif value > hi or (value == hi and found.group("hi_b") == ")"):
            op = "<=" if found.group("hi_b") == "]" else "<"
        else:
            return ""
        return f" [type={_NAMES[op]}]"
    bound = _BOUND.search(message)
    return f" [type={_NAMES[bound.group(1)]}]" if bound is not None else ""


# Field names that SamplingParams and the engine name in their ValueErrors.
_KNOWN_FIELDS = frozenset(
    {
        "n",
        "best_of",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "max_tokens",
        "min_tokens",
        "stop",
        "stop_token_ids",
        "logprobs",
        "prompt_logprobs",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "structured_outputs",
        "allowed_token_ids",
        "bad_words",
        "logit_bias",
        "truncate_prompt_tokens",
        "kv_transfer_params",
    }
)
