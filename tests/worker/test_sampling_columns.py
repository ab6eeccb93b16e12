"""SamplingColumns: the runner's sampling knobs per request, kept between steps."""

from __future__ import annotations

import torch

from asyncserve.sampling_params import SamplingParams
from asyncserve.worker.input_batch import CachedRequestState
from asyncserve.worker.runner_steps import sampling_rows, step_seed
from asyncserve.worker.sampling_columns import NO_LOGPROBS, SamplingColumns
from asyncserve.worker.sampling_metadata import SamplingMetadata

CPU = torch.device("cpu")
PARAMS = {
    "greedy": SamplingParams(temperature=0.0, logprobs=2),
    "topk": SamplingParams(temperature=0.7, top_k=50, seed=3),
    "topp": SamplingParams(temperature=1.2, top_p=0.9, min_p=0.05),
    "plain": SamplingParams(temperature=1.0, logprobs=0),
    "seeded_greedy": SamplingParams(temperature=0.0, seed=9),
}


def _table(num_rows: int = 2) -> SamplingColumns:
    table = SamplingColumns(num_rows=num_rows)
    for request_id, params in PARAMS.items():  # more than num_rows: the table grows
        table.add(request_id, params)
    return table


def test_rows_are_gathered_in_batch_order_and_freed_rows_reused() -> None:
    table = _table()
    columns = table.gather(["topp", "greedy", "topk"])
    assert columns.greedy.tolist() == [False, True, False]
    assert columns.temperature.tolist() == [1.2, 0.0, 0.7]
    assert columns.top_k.tolist() == [0, 0, 50]
    assert columns.top_p.tolist() == [0.9, 1.0, 1.0]
    assert columns.min_p.tolist() == [0.05, 0.0, 0.0]
    assert columns.logprobs.tolist() == [NO_LOGPROBS, 2, NO_LOGPROBS]
    # A greedy row samples without its generator, even when seeded.
    assert table.gather(["topk", "seeded_greedy"]).seeded.tolist() == [True, False]
    row = table.rows["plain"]
    table.remove("plain")
    table.remove("plain")  # unknown ids are ignored
    table.add("new", SamplingParams(temperature=0.5, top_k=7))
    assert table.rows["new"] == row
    assert table.gather(["new"]).top_k.tolist() == [7]
    assert table.gather(["new"]).logprobs.tolist() == [NO_LOGPROBS]


def test_penalties_and_other_rare_features_are_flagged() -> None:
    table = SamplingColumns()
    table.add("pen", SamplingParams(repetition_penalty=1.1))
    table.add("min", SamplingParams(min_tokens=3))
    table.add("bias", SamplingParams(logit_bias={1: 2.0}))
    table.add("plain", SamplingParams())
    assert table.gather(["pen", "min", "bias", "plain"]).extras.tolist() == [
        True,
        True,
        True,
        False,
    ]


def test_metadata_from_kept_columns_equals_metadata_from_the_rows() -> None:
    table = _table()
    states = {
        rid: CachedRequestState(rid, [1, 2], [3], params, [0], 3, {2})
        for rid, params in PARAMS.items()
    }
    order = ["topp", "seeded_greedy", "topk", "plain", "greedy"]
    columns = table.gather(order)
    generators: dict[str, torch.Generator] = {}
    rows = sampling_rows([states[rid] for rid in order], columns.seeded, generators, CPU)
    kept = SamplingMetadata.build(rows, 100, CPU, columns)
    fresh = SamplingMetadata.build(rows, 100, CPU)
    for name in vars(kept):
        a, b = getattr(kept, name), getattr(fresh, name)
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), name
        else:
            assert a == b, name
    assert kept.max_num_logprobs == 2
    assert kept.max_top_k == 50
    assert kept.temperature is not None and kept.temperature.tolist()[1] == 1.0
    # Only the seeded sampling row has a generator, seeded for this step.
    assert list(kept.generators) == [2] and list(generators) == ["topk"]
    expected = torch.Generator().manual_seed(step_seed(3, 1))
    assert torch.equal(
        torch.rand(4, generator=kept.generators[2]), torch.rand(4, generator=expected)
    )


def test_a_state_keeps_one_sampling_row_over_its_token_lists() -> None:
    state = CachedRequestState("a", [1, 2], [3], PARAMS["plain"], [0], 3, set())
    row = sampling_rows([state], _table().gather(["plain"]).seeded, {}, CPU)[0]
    assert row is state.sampling_row and row.generator is None
    state.output_token_ids.append(4)
    assert row.output_token_ids == [3, 4]
