"""Fused MoE (Triton) equals reference.moe_route / reference.fused_moe on small shapes."""

from __future__ import annotations

import pytest
import torch

from asyncserve.kernels import reference

triton = pytest.importorskip("triton", reason="triton is not installed")

from asyncserve.kernels import moe  # noqa: E402
from tests.kernels.paged_batch import rel_err  # noqa: E402

SMALL = moe.MoEConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=4, num_stages=2)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _experts(
    num_experts: int, hidden: int, inter: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(0)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen, device=device) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen, device=device) / inter**0.5
    return w13.to(dtype), w2.to(dtype)


@pytest.mark.parametrize(("scoring", "renormalize"), [("softmax", True), ("sigmoid", False)])
def test_route_matches_reference(device: torch.device, scoring: str, renormalize: bool) -> None:
    logits = torch.randn(7, 6, device=device, generator=torch.Generator(device).manual_seed(1))
    weights, ids = moe.moe_route(logits, 3, renormalize, scoring)
    ref_w, ref_ids = reference.moe_route(logits, 3, renormalize, scoring)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    ("num_tokens", "dtype"),
    [(1, torch.float32), (5, torch.float32), (21, torch.bfloat16)],
)
def test_fused_moe_matches_reference(
    device: torch.device, num_tokens: int, dtype: torch.dtype
) -> None:
    """8 experts top-2: one token (6 experts idle), and batches where some experts get no
    token (routing is skewed toward the first experts) and others several tiles' worth."""
    num_experts, hidden, inter = 8, 32, 24  # inter not a multiple of the 16-wide tiles
    w13, w2 = _experts(num_experts, hidden, inter, dtype, device)
    gen = torch.Generator(device=device).manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, generator=gen, device=device).to(dtype)
    logits = torch.randn(num_tokens, num_experts, generator=gen, device=device)
    logits[:, :3] += 3.0
    weights, ids = reference.moe_route(logits, 2, True)
    counts = torch.bincount(ids.reshape(-1).long(), minlength=num_experts)
    assert (counts == 0).any()
    out = moe.fused_moe(x, w13, w2, weights, ids, config=SMALL)
    ref = reference.fused_moe(x, w13, w2, weights, ids)
    assert out.shape == ref.shape and out.dtype == dtype
    assert rel_err(out, ref) < TOL[dtype]


def test_fused_moe_expert_parallel_partial_sums(device: torch.device) -> None:
    """Two ranks holding alternate experts: each rank's partial sum equals the reference's
    over the same local experts, and the two add up to the full layer."""
    num_experts, hidden, inter = 4, 32, 16
    w13, w2 = _experts(num_experts, hidden, inter, torch.float32, device)
    gen = torch.Generator(device=device).manual_seed(3)
    x = torch.randn(6, hidden, generator=gen, device=device)
    weights, ids = reference.moe_route(torch.randn(6, 4, generator=gen, device=device), 2, True)
    full = reference.fused_moe(x, w13, w2, weights, ids)
    total = torch.zeros_like(full)
    for rank in range(2):
        local = torch.arange(rank, num_experts, 2, device=device)
        expert_map = torch.full((num_experts,), -1, dtype=torch.int32, device=device)
        expert_map[local] = torch.arange(local.numel(), dtype=torch.int32, device=device)
        part = moe.fused_moe(x, w13[local], w2[local], weights, ids, expert_map, config=SMALL)
        ref = reference.fused_moe(x, w13[local], w2[local], weights, ids, expert_map)
        assert rel_err(part, ref) < 1e-5
        total += part
    assert rel_err(total, full) < 1e-5


def test_align_pads_each_expert_to_whole_tiles(device: torch.device) -> None:
    ids = torch.tensor([[2, 0], [2, 3], [2, 0]], dtype=torch.int32, device=device)
    sorted_ids, tile_experts, num_sorted = moe.align_by_expert(ids, 4, 4, None)
    n = int(num_sorted.item())
    assert n == 12  # experts 0, 2 and 3 each take one 4-row tile; expert 1 none
    assert tile_experts[: n // 4].tolist() == [0, 2, 3]
    pairs = sorted_ids[:n].view(-1, 4).tolist()
    assert pairs == [[1, 5, 6, 6], [0, 2, 4, 6], [3, 6, 6, 6]]  # 6 = T * k, padding


def test_config_default_buckets() -> None:
    assert moe.choose_config(1, 8, 64, "bfloat16", "").block_m == 16
    assert moe.choose_config(4096, 8, 64, "bfloat16", "").block_m == 64
