"""build_step_inputs: a StepPlan and the runner's request state -> the step's tensors."""

from __future__ import annotations

import numpy as np
import torch

from asyncserve.core.step import StepPlan
from asyncserve.sampling_params import SamplingParams
from asyncserve.worker.cuda_graphs import capture_sizes, padded_batch_size
from asyncserve.worker.input_batch import (
    PLACEHOLDER_TOKEN,
    CachedRequestState,
    HostStaging,
    build_step_inputs,
)

BLOCK = 4


def state(rid: str, prompt: list[int], output: list[int], blocks: list[int], computed: int):  # type: ignore[no-untyped-def]
    return CachedRequestState(rid, prompt, output, SamplingParams(), blocks, computed, set())


def test_a_prefill_chunk_and_a_decode() -> None:
    states = {
        # 10-token prompt, 3 cached (prefix hit), this step computes 5: no sampling yet.
        "p": state("p", list(range(100, 110)), [], [7, 8, 9], 3),
        # A running request at 6 computed tokens (5 prompt + 1 output): one decode token.
        "d": state("d", [1, 2, 3, 4, 5], [42, 43], [2, 5], 6),
    }
    plan = StepPlan(num_scheduled_tokens={"p": 5, "d": 1}, total_num_scheduled_tokens=6)
    inputs = build_step_inputs(plan, states, BLOCK, HostStaging(torch.device("cpu")))
    assert inputs.request_ids == ["p", "d"]
    assert inputs.input_ids.tolist() == [103, 104, 105, 106, 107, 43]
    assert inputs.positions.tolist() == [3, 4, 5, 6, 7, 6]
    # Slot = block id * block size + offset in the block.
    assert inputs.meta.slot_mapping.tolist() == [7 * 4 + 3, 8 * 4, 8 * 4 + 1, 8 * 4 + 2,
                                                 8 * 4 + 3, 5 * 4 + 2]  # fmt: skip
    assert inputs.meta.cu_seqlens_q.tolist() == [0, 5, 6]
    assert inputs.meta.seq_lens.tolist() == [8, 7]
    assert inputs.meta.block_tables[:, :3].tolist()[0] == [7, 8, 9]
    assert inputs.meta.block_tables[1, :2].tolist() == [2, 5]
    # Only the decode reaches its last known token and samples, from the last row.
    assert inputs.sample_request_ids == ["d"]
    assert inputs.logits_indices.tolist() == [5]
    assert inputs.placeholder_index is None


def test_a_placeholder_input_comes_from_the_last_steps_sampled_ids() -> None:
    sampled = torch.tensor([11, 77, 12])
    running = state("r", [1, 2, 3], [9, PLACEHOLDER_TOKEN], [0, 1], 4)
    running.in_flight = (sampled, 1)
    plan = StepPlan(num_scheduled_tokens={"r": 1}, total_num_scheduled_tokens=1)
    inputs = build_step_inputs(plan, {"r": running}, BLOCK, HostStaging(torch.device("cpu")))
    assert inputs.placeholder_index is not None and inputs.placeholder_rows is not None
    assert inputs.placeholder_index.tolist() == [0]
    assert inputs.placeholder_rows.tolist() == [1]
    assert inputs.placeholder_source is sampled
    assert inputs.sample_request_ids == ["r"]


def test_cuda_graph_buckets() -> None:
    sizes = capture_sizes(40)
    assert sizes == [1, 2, 4, 8, 16, 32, 40]
    assert padded_batch_size(sizes, 1) == 1
    assert padded_batch_size(sizes, 3) == 4
    assert padded_batch_size(sizes, 17) == 32
    assert padded_batch_size(sizes, 40) == 40
    assert padded_batch_size(sizes, 41) is None
    assert capture_sizes(1) == [1]


def test_a_decode_step_lists_its_sequences_longest_first() -> None:
    states = {
        "a": state("a", [1, 2], [3], [0], 2),  # context 3 this step
        "b": state("b", [1, 2, 3, 4], [5, 6], [1, 2], 5),  # 6
        "c": state("c", [1], [2, 3], [3], 2),  # 3: ties keep their listed order
        "d": state("d", [1, 2, 3, 4], [5], [4, 5], 4),  # 5
    }
    plan = StepPlan(
        num_scheduled_tokens={"a": 1, "b": 1, "c": 1, "d": 1}, total_num_scheduled_tokens=4
    )
    inputs = build_step_inputs(plan, states, BLOCK, HostStaging(torch.device("cpu")))
    assert inputs.meta.seq_lens.tolist() == [3, 6, 3, 5]
    assert inputs.meta.seq_order is not None
    assert inputs.meta.seq_order.dtype == torch.int32
    assert inputs.meta.seq_order.tolist() == [1, 3, 0, 2]


def test_steps_with_a_prefill_or_one_request_keep_the_listed_order() -> None:
    states = {
        "p": state("p", list(range(100, 110)), [], [7, 8, 9], 3),
        "d": state("d", [1, 2, 3, 4, 5], [42, 43], [2, 5], 6),
    }
    mixed = StepPlan(num_scheduled_tokens={"p": 5, "d": 1}, total_num_scheduled_tokens=6)
    staging = HostStaging(torch.device("cpu"))
    assert build_step_inputs(mixed, states, BLOCK, staging).meta.seq_order is None
    lone = StepPlan(num_scheduled_tokens={"d": 1}, total_num_scheduled_tokens=1)
    assert build_step_inputs(lone, states, BLOCK, staging).meta.seq_order is None


def test_staging_keeps_int32_parts_and_widens_the_others() -> None:
    """One copy carries every part: int32 ones come back int32 (no cast on the device),
    the others int64; each starts 16-byte aligned, as a tensor of its own would, empty
    parts included; a second, larger call reuses or grows the buffer with the same values."""
    staging = HostStaging(torch.device("cpu"))
    for scale in (1, 50):
        parts = [
            np.arange(3 * scale, dtype=np.int64) - 5,
            np.arange(5 * scale, dtype=np.int32) * 7,
            np.array([], dtype=np.int32),
            np.array([1, -1, 2], dtype=np.int16),
            np.arange(7, dtype=np.int32) - 3,
        ]
        out = staging.to_device(parts)
        assert [t.dtype for t in out] == [
            torch.int64, torch.int32, torch.int32, torch.int64, torch.int32,
        ]  # fmt: skip
        for tensor, part in zip(out, parts, strict=True):
            assert tensor.tolist() == part.tolist()
            assert tensor.data_ptr() % 16 == 0


def test_step_inputs_hold_int32_attention_metadata() -> None:
    states = {"d": state("d", [1, 2, 3, 4, 5], [42, 43], [2, 5], 6)}
    plan = StepPlan(num_scheduled_tokens={"d": 1}, total_num_scheduled_tokens=1)
    meta = build_step_inputs(plan, states, BLOCK, HostStaging(torch.device("cpu"))).meta
    assert meta.cu_seqlens_q.dtype == meta.seq_lens.dtype == meta.block_tables.dtype == torch.int32
    assert meta.slot_mapping.dtype == torch.int64
    assert meta.block_tables.tolist() == [[2, 5]]
