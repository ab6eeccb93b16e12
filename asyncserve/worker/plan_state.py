"""The runner's per-request state brought up to a step plan: requests freed, admitted and
advanced (the plan carries only diffs for running requests; see core/step.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncserve.core.step import StepPlan
from asyncserve.spec_decode.draft_proposer import DraftProposer
from asyncserve.spec_decode.eagle_proposer import EagleProposer
from asyncserve.worker.input_batch import CachedRequestState

if TYPE_CHECKING:
    from asyncserve.worker.model_runner import ModelRunner


def apply_plan(runner: ModelRunner, plan: StepPlan) -> None:
    states = runner.states
    for rid in plan.freed_request_ids:
        states.pop(rid, None)
        runner.block_table.remove(rid)
        runner.sampling_columns.remove(rid)
        runner.generators.pop(rid, None)
        if isinstance(runner.proposer, DraftProposer | EagleProposer):
            runner.proposer.forget(rid)
    lora = runner.lora
    if lora is not None and (plan.removed_lora_ids or lora.has_unloaded):
        in_use = {s.lora_request.lora_int_id for s in states.values() if s.lora_request}
        lora.unload(plan.removed_lora_ids, in_use)
    for new in plan.new_requests:
        params = new.sampling_params
        states[new.request_id] = CachedRequestState(
            request_id=new.request_id,
            prompt_token_ids=new.prompt_token_ids,
            output_token_ids=list(new.output_token_ids),
            sampling_params=params,
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            stop_token_ids=set(params.all_stop_token_ids),
            lora_request=new.lora_request,
            mm_features=new.mm_features,
        )
        runner.block_table.add(new.request_id, new.block_ids)
        runner.sampling_columns.add(new.request_id, params)
    for running in plan.running_requests:
        state = states[running.request_id]
        if running.new_block_ids:
            state.block_ids.extend(running.new_block_ids)
            runner.block_table.append(running.request_id, running.new_block_ids)
        state.num_computed_tokens = running.num_computed_tokens
        if running.new_token_ids is not None:
            # Pipeline stages: the last stage's sampled tokens (which it holds already).
            del state.output_token_ids[running.new_tokens_from :]
            state.output_token_ids.extend(running.new_token_ids)
