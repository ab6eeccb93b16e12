"""What a request yields: RequestOutput holding one CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Top logprobs at one position: token id -> Logprob.
LogprobsDict = dict[int, "Logprob"]


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1-based rank among the vocabulary
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[LogprobsDict] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[LogprobsDict | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    # Set when the request failed (finish_reason "error"): why.
    error: str | None = None
    # The failure is the server's fault (a bug while processing it), not the request's.
    internal_error: bool = False
    # Disaggregated prefill: what a producer tells the consumer (on the final output).
    kv_transfer_params: dict[str, Any] | None = None
