"""Request bodies as msgspec Structs: OpenAI's fields plus vLLM's sampling extras.

msgspec checks types on decode (a wrong type is a 400 naming the field); SamplingParams checks
values. Integers are bounded to 64 bits here so nothing unbounded reaches the engine.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from asyncserve.http.tools.protocol import ChatTool, DeltaToolCall, ToolCall, ToolChoice

# Bounds that keep every integer inside what torch and the engine take.
Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
Count = Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)]
MAX_N = 128


class StreamOptions(msgspec.Struct, kw_only=True):
    # As vLLM: a given stream_options object asks for usage unless include_usage says
    # otherwise. Nullable, as in vLLM and OpenAI's SDK types: an explicit null means false.
    include_usage: bool | None = True
    # vLLM: a usage object on every chunk, not only the last.
    continuous_usage_stats: bool | None = False


class StructuredOutputsRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `structured_outputs`: exactly one constraint on the output. vLLM's other
    options (whitespace_pattern, disable_any_whitespace, ...) are a 400 naming them, as an
    unknown top-level field is: dropped, they would leave a client believing they applied."""

    json: dict[str, Any] | str | None = None  # a JSON schema
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark, as llguidance takes it
    json_object: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """OpenAI's response_format: text, json_object, or json_schema {name, schema, strict}.
    Other keys (a `schema` beside json_object, say) are a 400 naming them, never dropped."""

    type: str
    json_schema: dict[str, Any] | None = None


class SamplingFields(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Fields every generation endpoint shares; None means "the model's default".

    An unknown field is a 400 naming it: a client must never believe a constraint applied
    that asyncserve does not implement."""

    model: str | None = None
    n: Count = 1
    best_of: Count | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: Int64 | None = None
    # Informational only in OpenAI's API (they change nothing in the output).
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    # vLLM extras.
    top_k: Count | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Count = 0
    ignore_eos: bool = False
    stop_token_ids: list[Int64] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: Count = 0
    request_id: str | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    response_format: ResponseFormat | None = None
    # vLLM's older names for structured_outputs' json, regex, choice and grammar.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    allowed_token_ids: list[Int64] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: Count | None = None
    # Disaggregated prefill (vLLM's field; see asyncserve/disagg/).
    kv_transfer_params: dict[str, Any] | None = None
    prompt_logprobs: Count | None = None
    # Tokens in logprobs as "token_id:<id>" (for tokens that are not valid UTF-8 alone);
    # None: the server's --return-tokens-as-token-ids.
    return_tokens_as_token_ids: bool | None = None
    # vLLM: token_ids (and prompt_token_ids) alongside the text.
    return_token_ids: bool | None = None
    # Beam search (vLLM): best_of (or n) beams, the best n returned.
    use_beam_search: bool = False
    length_penalty: float = 1.0


class CompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/completions. `prompt`: a string, a list of strings, a token-id list, or a
    list of token-id lists (one choice set per prompt)."""

    prompt: str | list[Any]
    max_tokens: Count | None = 16
    logprobs: Count | None = None
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True
    # vLLM extra: False gives token ids only (text "", as SamplingParams.detokenize).
    detokenize: bool = True


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None
    # {"url": "data:..." or "https://...", "detail": ...} (OpenAI's image part)
    image_url: dict[str, Any] | str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: Count | None = None
    tools: list[ChatTool] | None = None
    # Default: "auto" with tools, else "none".
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM extras: how the chat template is applied.
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class GenerateRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /generate (legacy): the reply holds prompt + completion for each of n samples."""

    prompt: str | list[Int64]
    n: Count = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: Count | None = None
    min_p: float | None = None
    max_tokens: Count | None = 16
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stream: bool = False
    best_of: Count | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0


# ---- responses -------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class UsageInfo(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class CompletionStreamChoice(msgspec.Struct):
    """One choice in a streamed chunk; the token-id fields appear only when asked for (and
    prompt_token_ids only on a choice's first chunk), as vLLM sends them."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET


class PerRequestMetrics(msgspec.Struct):
    """vLLM's `metrics` (--enable-per-request-metrics): one sequence's timings."""

    time_to_first_token_ms: float | None = None
    generation_time_ms: float | None = None
    queue_time_ms: float | None = None
    mean_itl_ms: float | None = None
    tokens_per_second: float | None = None


class PromptLogprob(msgspec.Struct):
    """vLLM's shape of one candidate at one prompt position."""

    logprob: float
    rank: int | None
    decoded_token: str | None


# Per prompt position (None for the first): token id -> its logprob.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionResponseChoice(CompletionChoice):
    prompt_logprobs: PromptLogprobs | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None
    system_fingerprint: str | None = None
    metrics: PerRequestMetrics | None = None
    kv_transfer_params: dict[str, Any] | None = None


class CompletionStreamResponse(msgspec.Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None
    metrics: PerRequestMetrics | None = None


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatLogprobEntry(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatLogprobEntry] | None


class ChatResponseMessage(msgspec.Struct):
    role: str
    content: str | None
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    metrics: PerRequestMetrics | None = None
    kv_transfer_params: dict[str, Any] | None = None


class DeltaMessage(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(msgspec.Struct):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET


class ChatCompletionStreamResponse(msgspec.Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    # With return_token_ids: on the role chunks that open the stream.
    prompt_token_ids: list[int] | None = None
    metrics: PerRequestMetrics | None = None


class ModelCard(msgspec.Struct):
    id: str
    object: str
    created: int
    owned_by: str
    root: str
    max_model_len: int
    parent: str | None = None


class ModelList(msgspec.Struct):
    object: str
    data: list[ModelCard]


class GenerateResponse(msgspec.Struct):
    text: list[str]


class HealthResponse(msgspec.Struct):
    status: str
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float


class LoadResponse(msgspec.Struct):
    """GET /load (vLLM): generation requests in flight (with --enable-server-load-tracking)."""

    server_load: int


class VersionResponse(msgspec.Struct):
    version: str
