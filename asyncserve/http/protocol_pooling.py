"""Request and response bodies of the pooling routes, in OpenAI's and vLLM's shapes."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

# A string, a list of strings, token ids, or a list of token-id lists (as OpenAI takes);
# the list's items are checked by the route (msgspec takes one list type in a union).
EmbeddingInput = str | list[Any]


class EmbeddingRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    input: EmbeddingInput
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True


class EmbeddingData(msgspec.Struct):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class PoolingData(msgspec.Struct):
    index: int
    data: list[float] | str
    object: str = "pooling"


class PoolingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class EmbeddingResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage
    object: str = "list"


class PoolingResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    data: list[PoolingData]
    usage: PoolingUsage
    object: str = "list"


class ScoreRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    truncate_prompt_tokens: int | None = None
    user: str | None = None


class ScoreData(msgspec.Struct):
    index: int
    score: float
    object: str = "score"


class ScoreResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage
    object: str = "list"


class RerankRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    query: str
    documents: list[str]
    model: str | None = None
    top_n: int | None = None
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
    user: str | None = None


class RerankDocument(msgspec.Struct):
    text: str


class RerankResult(msgspec.Struct, omit_defaults=True):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(msgspec.Struct):
    total_tokens: int


class RerankResponse(msgspec.Struct):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
