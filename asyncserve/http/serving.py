"""What every generation handler shares: the engine, served names, body decoding, prompt
tokenization and checks that turn bad input into a 400 before anything reaches the engine."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from starlette.requests import ClientDisconnect, Request

from asyncserve.config import ServerConfig
from asyncserve.core.grammar_allowed import NO_ALLOWED_TOKEN, NO_UNBANNED_TOKEN
from asyncserve.engine.request_checks import check_truncation
from asyncserve.http.engine_client import EngineClient
from asyncserve.http.errors import APIError, from_validation_error, from_value_error
from asyncserve.http.limits import (
    MAX_JSON_DEPTH,
    Admission,
    Preprocessor,
    Ticket,
    check_json_depth,
    check_prompt_chars,
    default_body_limit,
    read_body,
)
from asyncserve.http.logprobs import TokenText
from asyncserve.http.protocol import (
    PerRequestMetrics,
    PromptTokensDetails,
    StreamOptions,
    UsageInfo,
)
from asyncserve.http.sse import ClientDisconnected
from asyncserve.lora.adapter import check_adapter_files
from asyncserve.lora.request import LoRARequest
from asyncserve.metrics import ServerMetrics
from asyncserve.multimodal.inputs import MultiModalInputs
from asyncserve.outputs import RequestOutput
from asyncserve.sampling_params import SamplingParams

T = TypeVar("T")


def _decode_nulls_as_defaults(body: bytes, body_type: type[T]) -> T:
    """OpenAI's optional fields are nullable (clients send "n": null, "stream": null): a
    top-level null for a field with a default means that default, as in vLLM."""
    raw = msgspec.json.decode(body)
    if isinstance(raw, dict) and issubclass(body_type, msgspec.Struct):  # type: ignore[arg-type]
        defaulted = {f.encode_name for f in msgspec.structs.fields(body_type) if not f.required}
        raw = {k: v for k, v in raw.items() if v is not None or k not in defaulted}
    return msgspec.convert(raw, body_type)


logger = logging.getLogger("asyncserve.http.requests")
# Prompt characters (and token ids) logged per request when --max-log-len is not given.
DEFAULT_MAX_LOG_LEN = 512


@dataclass
class PromptInput:
    text: str | None  # None when the client sent token ids and nobody needs the text
    token_ids: list[int]
    # The prompt's images, processed (token_ids are then the expanded ids).
    mm_inputs: MultiModalInputs | None = None


@dataclass
class ServerState:
    engine: EngineClient
    config: ServerConfig
    model_names: tuple[str, ...]
    metrics: ServerMetrics
    created: int = field(default_factory=lambda: int(time.time()))
    # Set when the engine failed for good: the server stops and exits non-zero.
    fatal_error: str | None = None
    # Asks the HTTP server to stop (set by run_server).
    request_exit: Callable[[], None] | None = None
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    # Sampling defaults per --generation-config (the engine's, none, or a folder's).
    generation_config: dict[str, Any] = field(default_factory=dict)
    # In-flight generation requests (/load, with --enable-server-load-tracking).
    server_load: int = 0
    # LoRA adapters served by name (--lora-modules, /v1/load_lora_adapter).
    loras: dict[str, LoRARequest] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.model_names:
            raise ValueError("the server needs at least one served model name")
        self.token_text = TokenText(self.engine.tokenizer)
        self._id_prefix = uuid.uuid4().hex[:8]
        self.preprocessor = Preprocessor()
        # Set once --shutdown-timeout has run out after SIGTERM: streams end with an error.
        self.shutdown_deadline = asyncio.Event()
        self._deadline_waiter: asyncio.Future[Any] | None = None
        self.admission = Admission()
        self.body_limit = self.config.max_request_body_bytes or self._default_body_limit()

    def _default_body_limit(self) -> int:
        front_end = getattr(self.engine, "multimodal", None)
        if front_end is None or not front_end.supports_images:
            return default_body_limit(self.engine.max_model_len)
        multimodal = self.engine.config.multimodal
        return default_body_limit(
            self.engine.max_model_len,
            multimodal.limit("image"),
            multimodal.media_policy().max_bytes,
        )

    def shutdown_deadline_waiter(self) -> asyncio.Future[Any]:
        """Done once shutdown_deadline is set: one waiter that every stream shares (a task
        per stream cost objects the garbage collector walks, hundreds at a time)."""
        waiter = self._deadline_waiter
        if waiter is None or waiter.get_loop() is not asyncio.get_running_loop():
            waiter = self._deadline_waiter = asyncio.ensure_future(self.shutdown_deadline.wait())
        return waiter

    # ---- request plumbing ------------------------------------------------------------------

    async def read_json(self, request: Request, body_type: type[T]) -> T:
        """The body decoded into `body_type`: 413 over the size limit, 408 when it arrives
        too slowly, 400 naming the field (or the nesting limit)."""
        try:
            body = await read_body(request, self.body_limit, self.config.timeout_request_body)
        except ClientDisconnect:
            # A client that gives up mid-upload is routine: one line, no traceback.
            logger.info("client disconnected while sending %s", request.url.path)
            raise ClientDisconnected from None
        check_json_depth(body)
        try:
            try:
                return msgspec.json.decode(body, type=body_type)
            except msgspec.ValidationError as exc:
                if "got `null`" not in str(exc):
                    raise
                return _decode_nulls_as_defaults(body, body_type)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise from_validation_error(exc, body) from exc
        except UnicodeDecodeError as exc:
            raise APIError(f"the request body is not valid UTF-8: {exc}", 400) from exc
        except RecursionError:
            raise APIError(
                f"the request body is nested too deeply (limit {MAX_JSON_DEPTH})", 400
            ) from None

    def response_model(self, model: str | None) -> str:
        """The name to report; 400 when the client asked for a model this server lacks."""
        if model is None or model == "":
            return self.model_names[0]
        if model not in self.model_names and model not in self.loras:
            served = ", ".join((*self.model_names, *self.loras))
            raise APIError(
                f"The model `{model}` does not exist. Served models: {served}",
                400,
                "model",
                code="model_not_found",
            )
        return model

    def lora_for(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names; None for the base model. 400 when its
        folder went away since it was loaded (the runner reads it on first use)."""
        lora = self.loras.get(model) if model else None
        if lora is not None:
            # The runner could not read it since it was loaded: refused until loaded again.
            lora_error = getattr(self.engine, "lora_error", None)
            broken = lora_error(lora.lora_int_id) if lora_error is not None else None
            if broken is not None:
                raise APIError(broken, 400, "model")
            try:
                check_adapter_files(lora.lora_name, lora.lora_path)
            except ValueError as exc:
                raise APIError(str(exc), 400, "model") from None
        return lora

    def check_ready(self, priority: int = 0, count: int = 1) -> Ticket:
        """503 when the engine is down or the waiting queue is full; 400 for a bad priority.
        The returned ticket holds `count` places in the waiting count until the requests
        are scheduled (see Ticket.watch)."""
        if not self.engine.is_running:
            raise APIError("the engine is not running", 503, headers={"Retry-After": "5"})
        if priority != 0 and self.engine.config.scheduler.policy != "priority":
            raise APIError(
                "priority is only honored with --scheduling-policy priority", 400, "priority"
            )
        return self.admission.admit(
            self.engine.num_waiting, self.config.max_waiting_requests, count
        )

    def new_request_id(self) -> str:
        """A unique engine request id (client-given ids never reach the engine)."""
        return f"{self._id_prefix}-{next(self._ids)}"

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool) -> PromptInput:
        if isinstance(prompt, str):
            ids = self.engine.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
            return PromptInput(prompt, list(ids))
        return PromptInput(None, prompt)

    def prepare(
        self, prompt: str | list[int], add_special_tokens: bool, params: SamplingParams
    ) -> PromptInput:
        """Size check, tokenization and truncation of one prompt (blocking: call it through
        self.preprocessor)."""
        if isinstance(prompt, str) and params.truncate_prompt_tokens is None:
            check_prompt_chars(prompt, self.engine.max_model_len)
        return self.truncate(self.tokenize(prompt, add_special_tokens), params)

    def truncate(self, prompt: PromptInput, params: SamplingParams) -> PromptInput:
        """The prompt's last truncate_prompt_tokens tokens (-1: as many as max_model_len
        leaves room for), as the engine will see it."""
        keep = params.truncate_prompt_tokens
        if keep is None:
            return prompt
        try:
            check_truncation(keep, self.engine.max_model_len)
        except ValueError as exc:
            raise APIError(str(exc), 400, "truncate_prompt_tokens") from None
        if keep == -1:
            keep = self.engine.max_model_len - 1
        if len(prompt.token_ids) <= keep:
            return prompt
        return PromptInput(None, prompt.token_ids[-keep:])

    def token_text_for(self, return_tokens_as_token_ids: bool | None) -> TokenText:
        """The request's choice, else the server's --return-tokens-as-token-ids."""
        as_ids = return_tokens_as_token_ids
        if as_ids is None:
            as_ids = self.config.return_tokens_as_token_ids
        return self.token_text.with_ids() if as_ids else self.token_text

    def usage_flags(self, options: StreamOptions | None) -> tuple[bool, bool]:
        """(a final usage chunk, usage on every chunk), as vLLM decides them: per-chunk usage
        only with include_usage; --enable-force-include-usage turns both on."""
        if self.config.enable_force_include_usage:
            return True, True
        if options is None or not options.include_usage:
            return False, False
        return True, bool(options.continuous_usage_stats)

    def vocab_size(self) -> int:
        return int(getattr(self.engine.tokenizer, "vocab_size", 0) or 0) or 2**31 - 1

    def max_logprobs(self) -> int:
        """--max-logprobs, with -1 (and anything larger) meaning the vocabulary size."""
        limit = self.config.max_logprobs
        return self.vocab_size() if limit == -1 else min(limit, self.vocab_size())

    def resolve_logprobs(self, value: int | None, param: str, kind: str = "sample") -> int | None:
        """A logprobs count as the engine takes it: -1 is the vocabulary-wide maximum; over
        --max-logprobs is a 400 worded as vLLM's."""
        if value is None:
            return None
        if value < -1:
            raise APIError(
                f"`{param}` must be a positive value or -1, got {value} [type=greater_than_equal]",
                400,
                param,
            )
        limit = self.max_logprobs()
        count = self.vocab_size() if value == -1 else value
        if count > limit:
            raise APIError(
                f"Requested {kind} logprobs of {count}, which is greater than max allowed: "
                f"{limit} (--max-logprobs {self.config.max_logprobs}) [type=less_than_equal]",
                400,
                param,
            )
        return count

    def request_metrics(
        self, out: RequestOutput | None, num_tokens: int, single: bool
    ) -> PerRequestMetrics | None:
        """vLLM's per-request timing metrics for one finished sequence (None unless
        --enable-per-request-metrics, and for n > 1 or several prompts)."""
        if not self.config.enable_per_request_metrics or not single or out is None:
            return None
        return per_request_metrics(out.metrics, num_tokens)

    def base_request_id(self, request: Request, body_id: str | None) -> str:
        """vLLM's response id base: the X-Request-Id header, else the body's request_id,
        else a fresh id."""
        return request.headers.get("x-request-id") or body_id or self.new_request_id()

    def prompt_text(self, prompt: PromptInput) -> str:
        if prompt.text is None:
            prompt.text = self.engine.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)
        return prompt.text

    def validate(
        self,
        prompt: PromptInput,
        params: SamplingParams,
        prompt_param: str,
        max_tokens_param: str = "max_tokens",
        structured_param: str = "structured_outputs",
    ) -> None:
        """400 when the prompt is empty, has an unknown token id, or (with max_tokens) does
        not fit in max_model_len; the message gives both lengths."""
        try:
            self.engine.validate_request(prompt.token_ids, params)
            front_end = getattr(self.engine, "multimodal", None)
            if prompt.mm_inputs is None and front_end is not None:
                front_end.check_text_prompt(prompt.token_ids)  # placeholders need images
        except ValueError as exc:
            renames = {
                "prompt": prompt_param,
                "max_tokens": max_tokens_param,
                "structured_outputs": structured_param,
            }
            raise from_value_error(exc, prompt_param, renames) from exc

    def log_request(self, request_id: str, prompt: PromptInput, params: SamplingParams) -> None:
        if not self.config.enable_log_requests:
            return
        # Unbounded, one long prompt would write a line of megabytes.
        limit = self.config.max_log_len
        if limit is None:
            limit = DEFAULT_MAX_LOG_LEN
        text = prompt.text[:limit] if prompt.text is not None else None
        ids = prompt.token_ids[:limit]
        logger.info(
            "request %s: prompt %r, prompt_token_ids %s, params %s", request_id, text, ids, params
        )


def usage(
    outputs: list[RequestOutput], prompts: list[PromptInput], completion_tokens: int
) -> UsageInfo:
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    cached = sum(o.num_cached_tokens for o in outputs)
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def per_request_metrics(timings: dict[str, float], num_tokens: int) -> PerRequestMetrics:
    """The engine's timings (seconds from arrival: queue_s to scheduling, ttft_s to the first
    token, e2e_s to the finish) as vLLM's metrics; the finish stands in for the last token."""
    queue_s = timings.get("queue_s")
    ttft_s = timings.get("ttft_s")
    e2e_s = timings.get("e2e_s")
    metrics = PerRequestMetrics()
    if queue_s is not None:
        metrics.queue_time_ms = queue_s * 1000
    if queue_s is not None and ttft_s is not None:
        metrics.time_to_first_token_ms = (ttft_s - queue_s) * 1000
    if ttft_s is not None and e2e_s is not None:
        decode_s = max(e2e_s - ttft_s, 0.0)
        metrics.generation_time_ms = decode_s * 1000
        if num_tokens > 1:
            metrics.mean_itl_ms = decode_s / (num_tokens - 1) * 1000
    if queue_s is not None and e2e_s is not None and e2e_s > queue_s:
        metrics.tokens_per_second = num_tokens / (e2e_s - queue_s)
    return metrics


def engine_error(output: RequestOutput, engine: EngineClient) -> APIError:
    """A request the engine ended with an error: 503 if the engine died, an internal error
    (sent only inside a stream: a non-streaming response carries finish_reason "error"
    instead), else 400."""
    message = output.error or "the request failed in the engine"
    if output.internal_error:
        return APIError(message, 500, code="internal_error")
    if not engine.is_running:
        return APIError(f"the engine stopped: {message}", 503, headers={"Retry-After": "5"})
    # A conflict found mid-output names the field, as the same conflict found up front does.
    param = next(
        (
            field
            for field, prefix in (
                ("allowed_token_ids", NO_ALLOWED_TOKEN),
                ("bad_words", NO_UNBANNED_TOKEN),
            )
            if message.startswith(prefix)
        ),
        None,
    )
    return APIError(message, 400, param, code="request_failed")


def parse_prompts(prompt: str | list[Any]) -> list[str | list[int]]:
    """/v1/completions' `prompt`: a string, strings, token ids, or lists of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError("prompt must not be an empty list", 400, "prompt")
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(_is_token_id(t) for t in prompt):
        return [list(prompt)]
    if all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in prompt):
        return [list(p) for p in prompt]
    raise APIError(
        "prompt must be a string, a list of strings, a list of token ids or a list of "
        "non-empty token-id lists",
        400,
        "prompt",
    )


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63
