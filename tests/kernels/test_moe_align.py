"""The MoE align kernels equal the torch operations they replace: the one-launch kernel for
decode batches and the chunked kernels past it give the same sorted pairs, tile experts and
padded length, with experts that get no pairs, expert parallelism's other-rank experts, one
pair, tile sizes above the pair count, and (chunked) pairs that span chunk boundaries."""

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


@pytest.mark.parametrize(
    ("num_tokens", "top_k", "num_experts", "block_m"),
    [
        (moe_align.SMALL_MAX_PAIRS + 1, 1, 4, 16),  # one pair past the one-launch kernel
        (40, 8, 128, 64),  # Qwen3-MoE's routing: 5 chunks
        (33, 8, 40, 16),  # PowerMoE's, the last chunk partly filled
        (3, 2, 300, 16),  # more experts than the one-launch kernel takes
    ],
)
def test_chunked_kernels_equal_torch(
    num_tokens: int, top_k: int, num_experts: int, block_m: int
) -> None:
    gen = torch.Generator().manual_seed(num_tokens + num_experts)
    ids = torch.stack(
        [torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]
    )
    _both(ids.to(torch.int32), block_m, num_experts)


def test_chunked_one_expert_keeps_pair_order_across_chunks() -> None:
    # Every pair to expert 2 of 4, over three chunks: their order is the pairs' order.
    ids = torch.full((2 * moe_align.CHUNK + 5, 1), 2, dtype=torch.int32)
    _both(ids, 16, 4)
    sorted_ids, tile_experts, num_sorted = moe_align.align_by_expert(ids, 16, 4, None)
    assert sorted_ids[: ids.numel()].tolist() == list(range(ids.numel()))
    assert int(num_sorted) == 144 and set(tile_experts.tolist()[:9]) == {2}


def test_chunked_expert_parallel_map() -> None:
    gen = torch.Generator().manual_seed(3)
    expert_map = torch.full((16,), -1, dtype=torch.int32)
    expert_map[4:10] = torch.arange(6, dtype=torch.int32)
    ids = torch.randint(0, 16, (moe_align.SMALL_MAX_PAIRS, 2), generator=gen)
    _both(ids.to(torch.int32), 8, 6, expert_map)
    # Every pair to another rank: no tile at all.
    _both(torch.zeros(moe_align.SMALL_MAX_PAIRS + 7, 1, dtype=torch.int32), 8, 6, expert_map)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    ("num_tokens", "block_m"), [(1, 16), (16, 16), (17, 32), (256, 64), (8192, 128)]
)
def test_cuda_model_sizes(num_tokens: int, block_m: int) -> None:
    # Qwen3-30B-A3B's routing (128 experts, top 8) from one token to a full prefill chunk.
    gen = torch.Generator().manual_seed(num_tokens)
    ids = torch.rand(num_tokens, 128, generator=gen).topk(8, dim=1).indices.to(torch.int32)
    _both(ids.cuda(), block_m, 128)
