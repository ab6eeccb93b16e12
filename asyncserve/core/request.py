"""A request as the scheduler sees it: token ids, progress, status and KV block hashes."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from asyncserve.lora.request import LoRARequest
from asyncserve.multimodal.inputs import MultiModalFeatures
from asyncserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    max_tokens: int = 16  # resolved from sampling_params and max_model_len by the engine
    lora_request: LoRARequest | None = None
    # Images of the prompt: their placeholder runs and hashes (see multimodal/inputs.py).
    mm_features: MultiModalFeatures | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose K/V are in the cache (prefix hits included).
    num_computed_tokens: int = 0
    # Tokens sampled by a step in flight but not yet known here (async scheduling): the
    # next step already feeds them to the model, straight from the device.
    num_output_placeholders: int = 0
    # Prompt tokens served from the prefix cache at first scheduling.
    num_cached_tokens: int = -1
    # Chained hashes of this request's full blocks, extended as tokens arrive.
    block_hashes: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    # Proposed next tokens (speculative decoding), verified by the next step that runs it.
    spec_token_ids: list[int] = field(default_factory=list)
    stop_reason: int | str | None = None
    error: str | None = None
    # Monotonic timestamps for metrics.
    first_scheduled_time: float | None = None
    # Wall time of the steps it was in (only counted for detailed traces).
    model_execute_time: float = 0.0
    first_token_time: float | None = None
    # Nothing reads its tokens before it finishes (offline, final-only): Scheduler.update
    # leaves it out of the requests it returns until then.
    tokens_read_at_end: bool = False
    # Its sampling reads the output tokens' values (SamplingParams.needs_output_tokens),
    # read once at admission: the scheduler asks every step.
    needs_output_tokens: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """(prompt + output)[start:end] without concatenating the whole lists."""
        return token_slice(self.prompt_token_ids, self.output_token_ids, start, end)

    @property
    def lora_int_id(self) -> int:
        """The adapter's id; 0 without one."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED  # status.finished, one call less


def count_decodes(requests: Iterable[Request]) -> int:
    """How many have one token left to compute (known tokens plus the ones being sampled by
    a step in flight, past the computed ones): a decode. Runs over every running request
    every step, so the arithmetic is inline."""
    return sum(
        [
            len(r.prompt_token_ids) + len(r.output_token_ids) + r.num_output_placeholders
            == r.num_computed_tokens + 1
            for r in requests
        ]
    )


def token_slice(prompt: list[int], output: list[int], start: int, end: int) -> list[int]:
    """(prompt + output)[start:end] without concatenating the whole lists."""
    n_prompt = len(prompt)
    if end <= n_prompt:
        return prompt[start:end]
    if start >= n_prompt:
        return output[start - n_prompt : end - n_prompt]
    return prompt[start:] + output[: end - n_prompt]
