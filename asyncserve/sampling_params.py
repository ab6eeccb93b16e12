"""SamplingParams: how one request is decoded. Validated on construction (ValueError names the field)."""

from __future__ import annotations

import enum
import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

# A request's bad_words: more would slow every step of every request beside it.
MAX_BAD_WORDS = 1024


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries the whole text so far
    DELTA = 1  # every output carries only what is new
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class StructuredOutputsParams:
    """One constraint on the output; exactly one field is set."""

    json: str | dict[str, Any] | None = None  # a JSON schema
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # a Lark grammar, as llguidance takes it
    json_object: bool | None = None  # any JSON object

    def __post_init__(self) -> None:
        count = sum(
            x is not None and x is not False
            for x in (self.json, self.regex, self.choice, self.grammar, self.json_object)
        )
        if count != 1:
            raise ValueError(
                "structured_outputs: exactly one of json, regex, choice, grammar, json_object "
                f"must be set, got {count}"
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")
        # Checked here, not left to the grammar compiler's TypeErrors.
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(
                    f"structured_outputs.{name} must be a string, got {type(value).__name__}"
                )
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object must be a boolean")


# Sampling fields whose default comes from the model's generation_config, as vLLM reads it.
MODEL_SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


# The float fields checked against their ranges in SamplingParams._validate.
_REAL_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


# The flags checked to be booleans in SamplingParams._validate.
_BOOL_FIELDS = (
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "detokenize",
)


def _is_list_like(value: Any) -> bool:
    return isinstance(value, Iterable) and not isinstance(value, str | bytes | dict)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(cond: bool, field_name: str, message: str) -> None:
    if not cond:
        raise ValueError(f"{field_name} {message}")


def _clamped_bias(bias: Any) -> dict[int, float]:
    _check(isinstance(bias, dict), "logit_bias", "must be a mapping of token ids to biases")
    out: dict[int, float] = {}
    for token, value in bias.items():
        _check(
            isinstance(token, int) and not isinstance(token, bool) and token >= 0,
            "logit_bias",
            f"keys must be non-negative token ids, got {token!r}",
        )
        _check(
            isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value),
            "logit_bias",
            f"values must be finite numbers, got {value!r} for token {token}",
        )
        out[token] = min(100.0, max(-100.0, float(value)))
    return out


@dataclass
class SamplingParams:
    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # False: no text is made (CompletionOutput.text stays "", logprobs' decoded_token None);
    # token ids only, as vLLM's detokenize=False. Stop strings need the text.
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    # Sampling draws only from these token ids.
    allowed_token_ids: list[int] | None = None
    # Words never generated: the last token of each word's tokenization is ruled out where
    # the output so far ends with the rest of it.
    bad_words: list[str] | None = None
    # Token id -> a bias added to its logit before sampling (OpenAI's logit_bias); values
    # are clamped to [-100, 100] as vLLM does.
    logit_bias: dict[int, float] | None = None
    # Keep only the last k prompt tokens (-1: as many as max_model_len allows).
    truncate_prompt_tokens: int | None = None
    # Disaggregated prefill (vLLM's field): {"do_remote_decode": true} on a producer keeps
    # the prompt's KV blocks for a consumer; {"do_remote_prefill": true, "remote_url", ...}
    # on a consumer pulls them first (asyncserve/disagg/).
    kv_transfer_params: dict[str, Any] | None = None
    # Filled by the engine from the model's generation config; never set by users.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    # Filled by the engine from bad_words with the model's tokenizer.
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            _check(_is_list_like(self.stop), "stop", "must be a string or a list")
            self.stop = list(self.stop)
        _check(
            self.stop_token_ids is None or _is_list_like(self.stop_token_ids),
            "stop_token_ids",
            "must be a list of token ids",
        )
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()
        self.all_stop_token_ids = set(self.stop_token_ids)

    def _validate(self) -> None:
        # Numbers of the wrong type are a ValueError naming the field, not a TypeError below.
        for name in _REAL_FIELDS:
            value = getattr(self, name)
            _check(
                isinstance(value, numbers.Real) and not isinstance(value, bool),
                name,
                f"must be a number, got {value!r}",
            )
        _check(_is_int(self.n) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n}")
        if self.best_of is not None:
            # Nothing picks the best n of best_of: a larger best_of would be ignored.
            _check(
                _is_int(self.best_of) and self.best_of == self.n,
                "best_of",
                f"must equal n ({self.n}) when given: best_of > n is not supported, "
                f"got {self.best_of!r}",
            )
        _check(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(
            _is_int(self.top_k) and self.top_k >= 0,
            "top_k",
            f"must be 0 or -1 (disabled) or a positive integer, got {self.top_k}",
        )
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check(_is_int(self.seed), "seed", f"must be an integer, got {self.seed!r}")
        if self.max_tokens is not None:
            _check(
                _is_int(self.max_tokens) and self.max_tokens >= 1,
                "max_tokens",
                f"must be an integer >= 1, got {self.max_tokens}",
            )
        _check(
            _is_int(self.min_tokens) and self.min_tokens >= 0,
            "min_tokens",
            f"must be an integer >= 0, got {self.min_tokens}",
        )
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
            )
        assert isinstance(self.stop, list)
        _check(
            all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "must be a non-empty string or a list of non-empty strings",
        )
        # A string such as "false" would be truthy: the opposite of what was meant.
        for name in _BOOL_FIELDS:
            value = getattr(self, name)
            _check(isinstance(value, bool), name, f"must be a boolean, got {value!r}")
        # vLLM's rule and message: a stop string is found in the text, which is not made.
        _check(
            self.detokenize or not self.stop,
            "stop",
            "strings are only supported when detokenize is True. Set detokenize=True to use stop.",
        )
        assert self.stop_token_ids is not None
        _check(
            all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be a list of non-negative integers",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                # -1: the whole vocabulary (vLLM's). The upper bound is the server's
                # (--max-logprobs) or LLM's (max_logprobs); the engine turns -1 into a count.
                _check(
                    _is_int(value) and value >= -1,
                    name,
                    f"must be a non-negative integer or -1 (the whole vocabulary), got {value}",
                )
        _check(
            -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            f"must be in [-2, 2], got {self.presence_penalty}",
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            f"must be in [-2, 2], got {self.frequency_penalty}",
        )
        _check(
            self.repetition_penalty > 0.0,
            "repetition_penalty",
            f"must be > 0, got {self.repetition_penalty}",
        )
        if self.allowed_token_ids is not None:
            _check(
                isinstance(self.allowed_token_ids, list)
                and len(self.allowed_token_ids) > 0
                and all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0
                    for t in self.allowed_token_ids
                ),
                "allowed_token_ids",
                "must be a non-empty list of non-negative token ids",
            )
        if self.bad_words is not None:
            _check(
                isinstance(self.bad_words, list)
                and all(isinstance(w, str) and w.strip() for w in self.bad_words),
                "bad_words",
                "must be a list of non-empty strings",
            )
            # Each step scans every bad word's spellings for every row, in Python.
            _check(
                len(self.bad_words) <= MAX_BAD_WORDS,
                "bad_words",
                f"at most {MAX_BAD_WORDS} words, got {len(self.bad_words)}",
            )
        if self.logit_bias is not None:
            self.logit_bias = _clamped_bias(self.logit_bias)
        if self.truncate_prompt_tokens is not None:
            _check(
                _is_int(self.truncate_prompt_tokens)
                and (self.truncate_prompt_tokens >= 1 or self.truncate_prompt_tokens == -1),
                "truncate_prompt_tokens",
                f"must be -1 or an integer >= 1, got {self.truncate_prompt_tokens}",
            )
        _check(
            self.structured_outputs is None
            or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs",
            f"must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}",
        )
        _check(
            isinstance(self.output_kind, RequestOutputKind),
            "output_kind",
            "must be a RequestOutputKind",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def needs_output_tokens(self) -> bool:
        """Sampling reads the values of the output tokens so far (not only their count)."""
        if self.needs_penalties:
            return True
        return bool(self.bad_words_token_ids) and any(len(w) > 1 for w in self.bad_words_token_ids)

    @property
    def max_stop_len(self) -> int:
        assert isinstance(self.stop, list)
        return max((len(s) for s in self.stop), default=0)
