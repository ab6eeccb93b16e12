"""One schedule() call's choices (a StepBudget) as the plain-data StepPlan the runner reads:
new and resumed requests in full, running ones as diffs."""

from __future__ import annotations

from asyncserve.core.kv_cache_manager import KVCacheManager
from asyncserve.core.step import NewRequestData, RunningRequestData, StepPlan
from asyncserve.core.step_budget import StepBudget


def build_step_plan(
    step: StepBudget,
    kv: KVCacheManager,
    max_num_batched_tokens: int,
    freed_request_ids: set[str],
    removed_lora_ids: set[int],
) -> StepPlan:
    """The plan of `step`; the requests' num_computed_tokens are still their start positions."""
    return StepPlan(
        new_requests=[
            NewRequestData(
                request_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                output_token_ids=list(r.output_token_ids),
                sampling_params=r.sampling_params,
                block_ids=kv.get_block_ids(r.request_id),
                num_computed_tokens=r.num_computed_tokens,
                lora_request=r.lora_request,
                mm_features=r.mm_features,
            )
            for r in step.new
        ],
        running_requests=[
            RunningRequestData(
                request_id=r.request_id,
                new_block_ids=step.new_block_ids[r.request_id],
                num_computed_tokens=r.num_computed_tokens,
            )
            for r in step.running
        ],
        num_scheduled_tokens=step.num_scheduled,
        total_num_scheduled_tokens=max_num_batched_tokens - step.budget,
        freed_request_ids=freed_request_ids,
        removed_lora_ids=removed_lora_ids,
        scheduled_spec_tokens=step.spec,
    )
