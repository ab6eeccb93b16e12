"""BlockTable: the runner's block ids per request, kept between steps."""

from __future__ import annotations

import torch

from asyncserve.core.step import StepPlan
from asyncserve.sampling_params import SamplingParams
from asyncserve.worker.block_table import BlockTable
from asyncserve.worker.input_batch import CachedRequestState, HostStaging, build_step_inputs


def test_rows_are_added_extended_and_gathered_in_batch_order() -> None:
    table = BlockTable(num_rows=2, num_cols=2)
    table.add("a", [5, 6])
    table.add("b", [7])
    table.append("b", [8, 9, 10])  # past the first columns: the table widens
    table.add("c", [3])  # past the first rows: the table grows
    assert table.gather(["b", "a", "c"]).tolist() == [[7, 8, 9, 10], [5, 6, 0, 0], [3, 0, 0, 0]]
    assert table.gather(["a"]).tolist() == [[5, 6]]


def test_a_freed_row_is_reused_zeroed_and_a_resumed_request_replaces_its_row() -> None:
    table = BlockTable(num_rows=1, num_cols=4)
    table.add("a", [1, 2, 3, 4])
    table.remove("a")
    table.remove("a")  # unknown ids are ignored
    table.add("b", [9])
    assert table.gather(["b"]).tolist() == [[9]]
    assert table.table[table.rows["b"]].tolist() == [9, 0, 0, 0]
    table.add("b", [4, 5])  # resumed after preemption: its blocks in full again
    assert table.gather(["b"]).tolist() == [[4, 5]]


def test_inputs_from_a_kept_table_equal_inputs_built_from_the_states() -> None:
    params = SamplingParams()
    states = {
        "p": CachedRequestState("p", list(range(100, 110)), [], params, [7, 8, 9], 3, set()),
        "d": CachedRequestState("d", [1, 2, 3, 4, 5], [42, 43], params, [2, 5], 6, set()),
    }
    table = BlockTable()
    table.add("d", [2])
    table.add("p", [7, 8, 9])
    table.append("d", [5])
    plan = StepPlan(num_scheduled_tokens={"p": 5, "d": 1}, total_num_scheduled_tokens=6)
    staging = HostStaging(torch.device("cpu"))
    kept = build_step_inputs(plan, states, 4, staging, table)
    built = build_step_inputs(plan, states, 4, staging)
    assert kept.meta.block_tables.tolist() == built.meta.block_tables.tolist()
    assert kept.meta.block_tables.tolist() == [[7, 8, 9], [2, 5, 0]]
    assert kept.meta.slot_mapping.tolist() == built.meta.slot_mapping.tolist()
    assert kept.input_ids.tolist() == [103, 104, 105, 106, 107, 43]
