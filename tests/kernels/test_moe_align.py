"""The one-launch MoE align kernel equals the torch operations it replaces for decode batches:
the same sorted pairs, tile experts and padded length, with experts that get no pairs,
expert parallelism's other-rank experts, one pair, and tile sizes above the pair count."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from asyncserve.kernels import moe_align  # noqa: E402


def _both(
    ids: torch.Tensor, block_m: int, num_experts: int, expert_map: torch.Tensor | None = None
) -> None:
    got = moe_align.align_by_expert(ids, block_m, num_experts, expert_map)
    want = moe_align.align_by_expert_torch(ids, block_m, num_experts, expert_map)
    for g, w, name in zip(got, want, ("sorted_ids", "tile_experts", "num_sorted"), strict=True):
        assert g.dtype == w.dtype == torch.int32, name
        assert torch.equal(g, w), f"{name}: {g.tolist()} != {w.tolist()}"


@pytest.mark.parametrize(
    ("num_tokens", "top_k", "num_experts", "block_m"),
    [(1, 1, 4, 16), (1, 8, 40, 16), (3, 2, 4, 4), (5, 2, 8, 16), (16, 8, 40, 16), (4, 6, 64, 64)],
)
def test_kernel_equals_torch(num_tokens: int, top_k: int, num_experts: int, block_m: int) -> None:
    gen = torch.Generator().manual_seed(num_tokens * 100 + num_experts)
    # top-k ids are distinct per token, as the router gives them.
    ids = torch.stack(
        [torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]
    )
    _both(ids.to(torch.int32), block_m, num_experts)


def test_experts_without_pairs_and_shared_experts() -> None:
    # Experts 1 and 3 get nothing; expert 2 gets three pairs, expert 0 two.
    ids = torch.tensor([[2, 0], [2, 4], [2, 0]], dtype=torch.int32)
    _both(ids, 4, 5)
    sorted_ids, tile_experts, num_sorted = moe_align.align_by_expert(ids, 4, 5, None)
    assert int(num_sorted) == 12 and tile_experts.tolist()[:3] == [0, 2, 4]


def test_expert_parallel_map_drops_other_ranks_pairs() -> None:
    # 8 global experts, this rank holds 2, 5 and 7 (local 0, 1, 2).
    expert_map = torch.full((8,), -1, dtype=torch.int32)
    expert_map[torch.tensor([2, 5, 7])] = torch.arange(3, dtype=torch.int32)
    ids = torch.tensor([[2, 3], [5, 7], [0, 1], [7, 2]], dtype=torch.int32)
    _both(ids, 4, 3, expert_map)
    # A batch routed wholly to other ranks: no tile at all.
    _both(torch.tensor([[0, 1]], dtype=torch.int32), 4, 3, expert_map)


def test_the_largest_batch_the_kernel_takes() -> None:
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 128, (moe_align.SMALL_MAX_PAIRS // 4, 4), generator=gen)
    _both(ids.to(torch.int32), 16, 128)


def test_more_pairs_take_the_torch_path() -> None:
    ids = torch.zeros(moe_align.SMALL_MAX_PAIRS + 1, 1, dtype=torch.int32)
    got = moe_align.align_by_expert(ids, 16, 4, None)
    want = moe_align.align_by_expert_torch(ids, 16, 4, None)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
