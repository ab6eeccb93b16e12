"""StepPlan / StepResult: the plain-data contract between the scheduler and the model runner.

New requests (and requests resumed after preemption) travel in full; requests the runner
already holds travel as diffs (only their newly allocated blocks). The order of
`num_scheduled_tokens` is the batch order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from asyncserve.lora.request import LoRARequest
from asyncserve.multimodal.inputs import MultiModalFeatures
from asyncserve.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    request_id: str
    prompt_token_ids: list[int]
    # Output tokens so far: non-empty only when resumed after preemption (recompute).
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    # Tokens already in the cache (a prefix hit), so computing starts here.
    num_computed_tokens: int
    lora_request: LoRARequest | None = None
    # Images (pixel tensors, placeholder runs, hashes) and model positions; see multimodal/.
    mm_features: MultiModalFeatures | None = None


@dataclass
class RunningRequestData:
    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    # Pipeline parallelism: its output tokens from index new_tokens_from on, sampled since
    # it was last scheduled (only the last stage saw them); None otherwise.
    new_token_ids: list[int] | None = None
    new_tokens_from: int = 0


@dataclass
class StepPlan:
    new_requests: list[NewRequestData] = field(default_factory=list)
    running_requests: list[RunningRequestData] = field(default_factory=list)
    # request id -> tokens to compute this step, in batch order.
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # Requests the runner must forget (finished, aborted or preempted since the last step).
    freed_request_ids: set[str] = field(default_factory=set)
    # A scheduled request samples from its output tokens' values (penalties, bad words): with
    # a step in flight, this one samples only after that step's tokens are collected.
    needs_output_tokens: bool = False
    # LoRA adapters unloaded since the last step: the runner drops their cached weights.
    removed_lora_ids: set[int] = field(default_factory=set)
    # request id -> proposed tokens verified this step (speculative decoding); they are the
    # last of its scheduled tokens, after its last known token.
    scheduled_spec_tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class StepResult:
    # request id -> sampled token ids this step (empty for a partial prefill chunk).
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # request id -> per sampled token: (token id -> logprob) of the top-k plus the sampled one,
    # and the sampled token's 1-based rank.
    logprobs: dict[str, list[tuple[dict[int, float], int]]] = field(default_factory=dict)
    # request id -> (index of the first prompt token scored, per prompt token from there: top-k
    # logprobs and its rank); filled chunk by chunk. A request computed again after preemption
    # scores its prompt again, so positions may repeat across steps.
    prompt_logprobs: dict[str, tuple[int, list[tuple[dict[int, float], int]]]] = field(
        default_factory=dict
    )
    # request id -> tokens proposed to follow this step's tokens (speculative decoding).
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # request id -> why its rows could not run as asked (its LoRA adapter could not be read
    # on some rank): the rows ran without it, their outputs are void, the request fails.
    failed_requests: dict[str, str] = field(default_factory=dict)


def driver_result(replies: list[Any], driver: int) -> StepResult:
    """The driver rank's StepResult, with the requests any other rank failed (the others
    reply with their failures or None): a failure on one rank fails the request."""
    result = replies[driver]
    assert isinstance(result, StepResult)
    for rank, reply in enumerate(replies):
        if rank != driver and reply:
            for request_id, reason in reply.items():
                result.failed_requests.setdefault(request_id, reason)
    return result


@dataclass
class GrammarBitmask:
    """Packed allowed-token masks for the constrained rows of one step.

    Row i of `bitmask` ([R, ceil(V / 32)] int32, host memory, pinned on CUDA) belongs to
    `request_ids[i]`; bit t % 32 of word t // 32 is set when token t is allowed.
    """

    request_ids: list[str]
    bitmask: torch.Tensor
