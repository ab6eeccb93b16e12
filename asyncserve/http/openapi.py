"""/openapi.json: the endpoints and their bodies, schemas generated from the msgspec Structs."""

from __future__ import annotations

from typing import Any

import msgspec

from asyncserve.http.chat_batch import BatchChatCompletionRequest
from asyncserve.http.errors import ErrorResponse
from asyncserve.http.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    GenerateRequest,
    GenerateResponse,
    HealthResponse,
    LoadResponse,
    ModelList,
    VersionResponse,
)
from asyncserve.http.protocol_pooling import (
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingResponse,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
)
from asyncserve.http.routes_tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)

REF = "#/components/schemas/{name}"

# path -> (method, summary, request body type, JSON response type, streamed event type)
_ENDPOINTS: list[tuple[str, str, str, Any, Any, Any]] = [
    (
        "/v1/completions",
        "post",
        "Text completion (SSE events with stream=true)",
        CompletionRequest,
        CompletionResponse,
        CompletionStreamResponse,
    ),
    (
        "/v1/chat/completions",
        "post",
        "Chat completion through the model's chat template (SSE events with stream=true)",
        ChatCompletionRequest,
        ChatCompletionResponse,
        ChatCompletionStreamResponse,
    ),
    (
        "/generate",
        "post",
        "Legacy generation: prompt + completion per sample (NDJSON lines with stream=true)",
        GenerateRequest,
        GenerateResponse,
        GenerateResponse,
    ),
    (
        "/v1/chat/completions/batch",
        "post",
        "Several conversations (`messages`: a list of them), one choice each (vLLM)",
        BatchChatCompletionRequest,
        ChatCompletionResponse,
        None,
    ),
    (
        "/v1/embeddings",
        "post",
        "Embeddings (pooling models)",
        EmbeddingRequest,
        EmbeddingResponse,
        None,
    ),
    (
        "/pooling",
        "post",
        "Pooled hidden states (vLLM; pooling models)",
        EmbeddingRequest,
        PoolingResponse,
        None,
    ),
    (
        "/score",
        "post",
        "Relevance of text_2 to text_1 (vLLM; pooling models)",
        ScoreRequest,
        ScoreResponse,
        None,
    ),
    (
        "/rerank",
        "post",
        "Documents ranked by relevance to a query (pooling models)",
        RerankRequest,
        RerankResponse,
        None,
    ),
    ("/v1/models", "get", "The served model names", None, ModelList, None),
    ("/load", "get", "Generation requests in flight (vLLM)", None, LoadResponse, None),
    ("/health", "get", "200 while the engine loop runs, 503 otherwise", None, HealthResponse, None),
    (
        "/ping",
        "get",
        "/health's answer, also on POST (vLLM, SageMaker)",
        None,
        HealthResponse,
        None,
    ),
    ("/version", "get", "Server version", None, VersionResponse, None),
    (
        "/tokenize",
        "post",
        "Token ids of a prompt, or of chat messages through the chat template (vLLM)",
        TokenizeRequest,
        TokenizeResponse,
        None,
    ),
    (
        "/detokenize",
        "post",
        "Text of token ids (vLLM)",
        DetokenizeRequest,
        DetokenizeResponse,
        None,
    ),
]


# The value ranges SamplingParams enforces (a 400 outside them), for schema-driven clients.
_BOUNDS: dict[str, dict[str, float]] = {
    "n": {"minimum": 1},
    "best_of": {"minimum": 1},
    "temperature": {"minimum": 0},
    "top_p": {"exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"minimum": -1},
    "min_p": {"minimum": 0, "maximum": 1},
    "max_tokens": {"minimum": 1},
    "max_completion_tokens": {"minimum": 1},
    "min_tokens": {"minimum": 0},
    "presence_penalty": {"minimum": -2, "maximum": 2},
    "frequency_penalty": {"minimum": -2, "maximum": 2},
    "repetition_penalty": {"exclusiveMinimum": 0},
    "truncate_prompt_tokens": {"minimum": -1},
}


def _add_bounds(components: dict[str, Any]) -> None:
    for name, component in components.items():
        if not name.endswith("Request"):
            continue
        for field, prop in component.get("properties", {}).items():
            bounds = _BOUNDS.get(field)
            if bounds is None:
                continue
            # Optional fields are anyOf [number, null]: bound the number branch.
            branches = prop.get("anyOf", [prop])
            for branch in branches:
                if branch.get("type") in ("integer", "number"):
                    branch.update(bounds)


def _ref(cls: Any) -> dict[str, str]:
    return {"$ref": REF.format(name=cls.__name__)}


def _json_content(cls: Any) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(cls)}}


def openapi_schema(version: str, auth: bool) -> dict[str, Any]:
    types = {
        t for _, _, _, req, resp, event in _ENDPOINTS for t in (req, resp, event) if t is not None
    }
    types.add(ErrorResponse)
    ordered = sorted(types, key=lambda t: t.__name__)
    _, components = msgspec.json.schema_components(ordered, ref_template=REF)
    _add_bounds(components)
    errors = {
        str(code): {"description": text, "content": _json_content(ErrorResponse)}
        for code, text in (
            (400, "Invalid request; `error.param` names the field"),
            (401, "Missing or wrong API key"),
            (408, "Request headers or body not received in time"),
            (413, "Request body over the size limit"),
            (503, "Engine down or overloaded (see Retry-After)"),
        )
    }
    paths: dict[str, Any] = {}
    for path, method, summary, req, resp, event in _ENDPOINTS:
        ok: dict[str, Any] = {"description": "OK", "content": _json_content(resp)}
        if event is not None:
            media = "application/x-ndjson" if path == "/generate" else "text/event-stream"
            ok["content"][media] = {"schema": _ref(event)}
        op: dict[str, Any] = {"summary": summary, "responses": {"200": ok}}
        if req is not None:
            op["requestBody"] = {"required": True, "content": _json_content(req)}
            op["responses"].update(errors)
        if auth and path not in ("/health", "/ping", "/load"):
            op["security"] = [{"bearer": []}]
            op["responses"]["401"] = errors["401"]
        paths[path] = {method: op}
    paths["/ping"]["post"] = paths["/ping"]["get"]
    paths["/invocations"] = {
        "post": {
            "summary": "A chat completion body (`messages`) or a completion body (`prompt`), "
            "answered as on its own route (vLLM, SageMaker)",
            "responses": {"200": {"description": "OK"}, **errors},
        }
    }
    if auth:
        paths["/invocations"]["post"]["security"] = [{"bearer": []}]
    paths["/metrics"] = {
        "get": {
            "summary": "Prometheus metrics (vLLM names, as asyncserve:* and vllm:*)",
            "responses": {"200": {"description": "OK", "content": {"text/plain": {}}}},
        }
    }
    paths["/dashboard"] = {
        "get": {
            "summary": "Live dashboard of the server's metrics (HTML; the API key is also "
            "taken as an HTTP Basic password)",
            "responses": {"200": {"description": "OK", "content": {"text/html": {}}}},
        }
    }
    if auth:
        paths["/dashboard"]["get"]["security"] = [{"bearer": []}, {"basic": []}]
        paths["/dashboard"]["get"]["responses"]["401"] = errors["401"]
    schema: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "asyncserve", "version": version},
        "paths": paths,
        "components": {"schemas": components},
    }
    if auth:
        schema["components"]["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"},
            "basic": {"type": "http", "scheme": "basic"},
        }
    return schema
