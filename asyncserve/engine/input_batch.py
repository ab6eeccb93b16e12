"""Turns the runner's per-request state and a StepPlan into the step's input tensors."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from asyncserve.engine.step import StepPlan
from asyncserve.models.attention import AttentionMetadata
from asyncserve.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """What the runner remembers of a request between steps."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    stop_token_ids: set[int]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    # Batch order of the requests in this step.
    request_ids: list[str]
    # Start position of each request's chunk and its scheduled count.
    starts: list[int]
    counts: list[int]
    # Requests whose chunk reaches their last known token: they sample this step.
    sample_request_ids: list[str]
    # Row in the flattened tokens whose hidden state feeds each sampled request.
    logits_indices: torch.Tensor  # [num_sample] int64


def build_step_inputs(
    plan: StepPlan,
    states: dict[str, CachedRequestState],
    block_size: int,
    device: torch.device,
) -> StepInputs:
    request_ids = list(plan.num_scheduled_tokens)
    counts = [plan.num_scheduled_tokens[rid] for rid in request_ids]
    total = sum(counts)
    num_reqs = len(request_ids)

    token_ids: list[int] = []
    starts: list[int] = []
    seq_lens = np.empty(num_reqs, dtype=np.int32)
    cu_seqlens = np.zeros(num_reqs + 1, dtype=np.int32)
    max_blocks = 1
    sample_request_ids: list[str] = []
    logits_indices: list[int] = []
    for i, rid in enumerate(request_ids):
        state = states[rid]
        start = state.num_computed_tokens
        end = start + counts[i]
        starts.append(start)
        token_ids.extend(state.token_slice(start, end))
        seq_lens[i] = end
        cu_seqlens[i + 1] = cu_seqlens[i] + counts[i]
        max_blocks = max(max_blocks, len(state.block_ids))
        if end >= state.num_tokens:
            sample_request_ids.append(rid)
            logits_indices.append(int(cu_seqlens[i + 1]) - 1)

    block_tables = np.zeros((num_reqs, max_blocks), dtype=np.int32)
    for i, rid in enumerate(request_ids):
        ids = states[rid].block_ids
        block_tables[i, : len(ids)] = ids

    # Positions and slots for every token, vectorised: token t of request i sits at
    # starts[i] + (t - cu[i]).
    req_index = np.repeat(np.arange(num_reqs), counts)
    positions = np.arange(total, dtype=np.int64) - np.repeat(cu_seqlens[:-1], counts)
    positions += np.repeat(np.asarray(starts, dtype=np.int64), counts)
    block_of_token = block_tables[req_index, positions // block_size].astype(np.int64)
    slot_mapping = block_of_token * block_size + positions % block_size

    pin = device.type == "cuda"

    def to_device(array: np.ndarray | list[int], dtype: torch.dtype) -> torch.Tensor:
        t = torch.as_tensor(np.asarray(array), dtype=dtype)
        if pin:
            t = t.pin_memory()
        return t.to(device, non_blocking=pin)

    meta = AttentionMetadata(
        slot_mapping=to_device(slot_mapping, torch.int64),
        cu_seqlens_q=to_device(cu_seqlens, torch.int32),
        seq_lens=to_device(seq_lens, torch.int32),
        block_tables=to_device(block_tables, torch.int32),
        max_seqlen_q=max(counts) if counts else 0,
        max_seqlen_k=int(seq_lens.max()) if num_reqs else 0,
    )
    return StepInputs(
        input_ids=to_device(token_ids, torch.int64),
        positions=to_device(positions, torch.int64),
        meta=meta,
        request_ids=request_ids,
        starts=starts,
        counts=counts,
        sample_request_ids=sample_request_ids,
        logits_indices=to_device(logits_indices, torch.int64),
    )
