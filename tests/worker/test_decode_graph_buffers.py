"""A decode step copied into the CUDA graph buffers (on the CPU: the copies, not the replay)
carries attention's program order: the step's, padding requests after it, and the listed
order for a step without one."""

from __future__ import annotations

import torch

from asyncserve.models.attention import AttentionMetadata
from asyncserve.worker.cuda_graphs import DecodeGraphs

CPU = torch.device("cpu")


def _step(
    lens: list[int], order: list[int] | None
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    n = len(lens)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, dtype=torch.int64),
        cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.zeros((n, 2), dtype=torch.int32),
        max_seqlen_q=1,
        max_seqlen_k=max(lens),
        seq_order=torch.tensor(order, dtype=torch.int32) if order is not None else None,
    )
    return torch.zeros(n, dtype=torch.int64), torch.tensor(lens) - 1, meta


def test_the_step_order_reaches_the_graph_buffers() -> None:
    graphs = DecodeGraphs(lambda *args: (), 8, 64, 16, CPU)
    # A larger step first: its order must not linger in the padding rows of the next.
    size = graphs.fill(*_step([9, 30, 2, 7, 5, 3, 4, 8], [1, 0, 7, 3, 4, 6, 5, 2]))
    assert size == 8
    size = graphs.fill(*_step([4, 12, 7], [1, 2, 0]))
    assert size == 4
    _, _, meta = graphs.inputs(size)
    assert meta.seq_order is not None
    assert meta.seq_order.tolist() == [1, 2, 0, 3]
    assert meta.seq_lens.tolist() == [4, 12, 7, 1]
    assert graphs.seq_order.tolist() == [1, 2, 0, 3, 4, 5, 6, 7]


def test_a_step_without_an_order_replays_the_listed_one() -> None:
    graphs = DecodeGraphs(lambda *args: (), 8, 64, 16, CPU)
    graphs.fill(*_step([4, 12, 7], [1, 2, 0]))
    size = graphs.fill(*_step([5, 6], None))
    _, _, meta = graphs.inputs(size)
    assert meta.seq_order is not None
    assert meta.seq_order.tolist() == [0, 1]


def test_padding_inputs_list_the_requests_in_order() -> None:
    """The forward a capture runs first (on padding inputs) must not read a larger step's
    order, which names requests past the captured size."""
    seen: list[list[int]] = []

    def forward(ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> tuple:
        assert meta.seq_order is not None
        seen.append(meta.seq_order.tolist())
        return ()

    graphs = DecodeGraphs(forward, 8, 64, 16, CPU)
    graphs.fill(*_step([9, 30, 2, 7, 5, 3, 4, 8], [1, 0, 7, 3, 4, 6, 5, 2]))
    graphs.run_each_size([4])
    assert seen == [[0, 1, 2, 3]]
