"""SpeculativeConfig: vLLM's `speculative_config` keys, checked once at engine start.

Bad values raise ValueError with a one-line message naming the key, so `serve` fails at
start instead of on the first request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from asyncserve.sampling_params import SamplingParams

METHODS = ("ngram", "draft_model", "eagle", "eagle3")
MAX_SPECULATIVE_TOKENS = 32
_KEYS = frozenset(
    {"method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}
)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    # n-gram: the shortest and longest suffix looked up in the request's own tokens.
    prompt_lookup_min: int = 0
    prompt_lookup_max: int = 0
    # Draft model: a directory or GGUF file the loader accepts; EAGLE: the head's directory.
    model: str | None = None

    @property
    def num_lookahead_tokens(self) -> int:
        """Slots the scheduler holds past each step for the proposer to write K/V into."""
        return self.num_speculative_tokens if self.method != "ngram" else 0

    @classmethod
    def from_value(cls, value: SpeculativeConfig | dict[str, Any] | str) -> SpeculativeConfig:
        """From a dict (LLM(speculative_config=...)) or its JSON text (--speculative-config)."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object")
        unknown = sorted(set(value) - _KEYS)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}")
        model = value.get("model")
        if model is not None and (not isinstance(model, str) or not model):
            raise ValueError(
                f"speculative_config: model must be a path (a directory or .gguf file), "
                f"got {model!r}"
            )
        # As in vLLM: a model without a method is a draft model.
        method = value.get("method") or ("draft_model" if model is not None else None)
        if method == "[ngram]":
            method = "ngram"
        if method not in METHODS:
            raise ValueError(
                f"speculative_config: method must be one of {', '.join(METHODS)}, got {method!r}"
            )
        k = value.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                "speculative_config: num_speculative_tokens must be an integer in "
                f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}"
            )
        if method == "ngram":
            if model is not None:
                raise ValueError("speculative_config: method 'ngram' takes no model")
            lo, hi = _lookup_window(value.get("prompt_lookup_min"), value.get("prompt_lookup_max"))
            return cls(method, k, prompt_lookup_min=lo, prompt_lookup_max=hi)
        if not isinstance(model, str) or not model:
            raise ValueError(f"speculative_config: method {method!r} needs a model")
        return cls(method, k, model=model)


def _lookup_window(lo: object, hi: object) -> tuple[int, int]:
    """vLLM's defaults: 5 and 5 when neither is given, else the missing one mirrors the other."""
    for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {v!r}")
    if lo is None and hi is None:
        lo = hi = 5
    elif lo is None:
        lo = hi
    elif hi is None:
        hi = lo
    assert isinstance(lo, int) and isinstance(hi, int)
    if lo > hi:
        raise ValueError(
            f"speculative_config: prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})"
        )
    return lo, hi


def can_speculate(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether a request's next tokens may be proposed and verified in one step.

    Verification samples every proposed position with the same processing; features whose
    processing depends on the output so far at each position (penalties, multi-token bad
    words, min_tokens not yet reached) and logprobs decode one token a step. Grammars do
    speculate: each proposed position gets the mask after the proposals before it.
    """
    return (
        not params.needs_output_tokens
        and params.logprobs is None
        and num_output_tokens >= params.min_tokens
    )
