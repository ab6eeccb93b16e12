"""4-bit weight-only matmuls (Triton) equal their reference: the GEMV (one to four tokens),
the whole-group GEMM (no g_idx) and the per-column dequant-GEMM (act-order g_idx), ragged M,
N and K tails, explicit tiles."""

from __future__ import annotations

import pytest
import torch

from asyncserve.kernels import quant_reference as reference

pytest.importorskip("triton", reason="triton is not installed")

from asyncserve.kernels.int4_gemm import (  # noqa: E402
    GEMV_MAX_TOKENS,
    GroupGemmConfig,
    group_gemm_config,
    int4_group_gemm,
    int4_matmul,
)


def _weight(n: int, k: int, group: int, act_order: bool, device: torch.device):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(n * k)
    values = torch.randint(0, 16, (n, k), generator=g)
    scales = torch.rand(n, k // group, generator=g) * 0.02
    zeros = torch.randint(0, 16, (n, k // group), generator=g).float()
    g_idx = None
    if act_order:
        g_idx = (torch.randperm(k, generator=g) // group).to(torch.int32).to(device)
    qweight = reference.pack_int4(values).to(device)
    return qweight, scales.to(device), zeros.to(device), g_idx


def test_act_order_rank_slice_matches_reference(device: torch.device) -> None:
    """A row-parallel rank of an act-order layer: its 64 of 128 columns draw on all the
    layer's groups (scales and zeros [N, 128 / group], g_idx of its columns only)."""
    n, k, group = 64, 128, 32
    qweight, scales, zeros, _ = _weight(n, k, group, False, device)
    g_idx = torch.randperm(k, generator=torch.Generator().manual_seed(3)) // group
    half = reference.pack_int4(reference.unpack_int4(qweight)[:, 64:]).contiguous()
    g_half = g_idx[64:].to(torch.int32).to(device)
    assert g_half.unique().numel() == k // group  # the slice reaches every group
    for m in (1, 20):  # the GEMV and the GEMM
        x = torch.randn(m, 64, generator=torch.Generator().manual_seed(m)).to(device)
        out = int4_matmul(x, half, scales, zeros, g_half, group)
        ref = reference.int4_matmul(x, half, scales, zeros, g_half, group)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m", [1, GEMV_MAX_TOKENS, 20])
@pytest.mark.parametrize(
    ("n", "k", "group", "act_order"),
    [(96, 256, 128, False), (64, 192, 64, True), (48, 96, 32, True)],  # ragged K tiles
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_matmul_matches_reference(
    device: torch.device,
    m: int,
    n: int,
    k: int,
    group: int,
    act_order: bool,
    dtype: torch.dtype,
) -> None:
    qweight, scales, zeros, g_idx = _weight(n, k, group, act_order, device)
    scales, zeros = scales.to(dtype), zeros.to(dtype)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(device, dtype)
    out = int4_matmul(x, qweight, scales, zeros, g_idx, group)
    ref = reference.int4_matmul(x, qweight, scales, zeros, g_idx, group)
    assert out.dtype == dtype and out.shape == (m, n)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    ("m", "n", "k", "group", "config"),
    [
        (70, 136, 256, 128, None),  # two M tiles of 64, a ragged N tile
        (5, 40, 80, 32, None),  # K ends inside a group: the masked last step
        (33, 64, 256, 128, GroupGemmConfig(16, 32, 64)),  # steps of half a group
        (17, 48, 128, 64, GroupGemmConfig(32, 16, 64, num_warps=2, num_stages=2)),
        (5, 40, 512, 128, GroupGemmConfig(16, 32, 64, split_k=3)),  # a shorter last split
        (6, 32, 400, 16, GroupGemmConfig(16, 16, 16, split_k=4)),  # K ends inside a split
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_gemm_tiles(
    device: torch.device,
    m: int,
    n: int,
    k: int,
    group: int,
    config: GroupGemmConfig | None,
    dtype: torch.dtype,
) -> None:
    g = torch.Generator().manual_seed(m + n + k)
    values = torch.randint(0, 16, (n, k), generator=g)
    groups = -(-k // group)
    scales = (torch.rand(n, groups, generator=g) * 0.02 + 0.001).to(device, dtype)
    zeros = torch.randint(0, 16, (n, groups), generator=g).to(device, dtype)
    qweight = reference.pack_int4(values).to(device)
    x = torch.randn(m, k, generator=g).to(device, dtype)
    out = int4_matmul(x, qweight, scales, zeros, None, group, config)
    ref = reference.int4_matmul(x, qweight, scales, zeros, None, group)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


def test_group_gemm_config_by_tokens() -> None:
    """Short prompts take one row of tiles; long ones and wide layers taller tiles; a step
    never spans two groups."""
    assert group_gemm_config(5, 4096, 128).block_m == 16
    assert group_gemm_config(5, 4096, 128).block_n == 128
    assert group_gemm_config(5, 28672, 128).block_n == 128
    assert group_gemm_config(17, 4096, 128).block_n == 64
    assert group_gemm_config(40, 4096, 128).block_m == 64
    assert group_gemm_config(128, 4096, 128).block_m == 64
    assert group_gemm_config(128, 28672, 128).block_m == 128
    assert group_gemm_config(4096, 4096, 128).block_m == 128
    assert group_gemm_config(128, 4096, 32).block_k == 32
    assert group_gemm_config(128, 4096, 256).block_k == 128


def test_group_gemm_config_splits_k_to_fill_the_sms() -> None:
    """K splits give the grid about 1.5 programs an SM (132 SMs: Llama-3-8B's layers at 16
    and 128 tokens as swept); a grid that fills the GPU, or the CPU, keeps K whole."""

    def splits(m: int, n: int, k: int, sms: int = 132) -> int:
        return group_gemm_config(m, n, 128, k, sms).split_k

    assert splits(16, 6144, 4096) == 8  # 48 tiles
    assert splits(16, 4096, 4096) == 8
    assert splits(16, 4096, 14336) == 7  # 112 steps: the fewest splits that divide them
    assert splits(16, 28672, 4096) == 1  # 224 tiles already
    assert splits(128, 4096, 4096) == 2
    assert splits(128, 28672, 4096) == 1
    assert splits(16, 4096, 4096, sms=1) == 1
    assert splits(16, 4096, 4000) == 1  # K not in whole steps: the split layout needs them


def test_int4_matmul_rejects_a_mismatched_weight(device: torch.device) -> None:
    qweight, scales, zeros, _ = _weight(64, 128, 64, False, device)
    with pytest.raises(ValueError, match="does not match an int4 weight"):
        int4_matmul(torch.randn(2, 64, device=device), qweight, scales, zeros, None, 64)


@pytest.mark.parametrize("split_k", [1, 2, 8])
def test_group_gemm_one_token_in_splits(device: torch.device, split_k: int) -> None:
    """The whole-group GEMM at one token (a tile of 16 rows, one of them real), K split."""
    g = torch.Generator().manual_seed(split_k)
    n, k, group = 40, 1024, 128
    values = torch.randint(0, 16, (n, k), generator=g)
    scales = (torch.rand(n, k // group, generator=g) * 0.02 + 0.001).to(device)
    zeros = torch.randint(0, 16, (n, k // group), generator=g).float().to(device)
    qweight = reference.pack_int4(values).to(device)
    x = torch.randn(1, k, generator=g).to(device)
    out = torch.full((1, n), float("nan"), device=device)
    int4_group_gemm(
        x, qweight, scales, zeros, group, out, GroupGemmConfig(16, 16, 128, split_k=split_k)
    )
    ref = reference.int4_matmul(x, qweight, scales, zeros, None, group)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("m", "group", "act_order"),
    [
        (1, 32, False),  # the GEMV's whole-group path
        (3, 24, False),  # the GEMV's per-column path (odd group size)
        (2, 32, True),  # the GEMV with a g_idx
        (20, 32, False),  # the whole-group GEMM
        (20, 32, True),  # the per-column dequant-GEMM
    ],
)
def test_symmetric_weights_read_no_zeros(
    device: torch.device, m: int, group: int, act_order: bool
) -> None:
    """zeros None (symmetric: every zero SYMMETRIC_ZERO) gives exactly what zeros of 8 give,
    on every kernel; the reference agrees; the gated GEMV and kept splits likewise."""
    from asyncserve.kernels.int4_gemv import GemvConfig, int4_gemv

    n, k = 48, 96
    qweight, scales, _, g_idx = _weight(n, k, group, act_order, device)
    eights = torch.full_like(scales, float(reference.SYMMETRIC_ZERO))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(device)
    out = int4_matmul(x, qweight, scales, None, g_idx, group)
    torch.testing.assert_close(
        out, int4_matmul(x, qweight, scales, eights, g_idx, group), rtol=0, atol=0
    )
    ref = reference.int4_matmul(x, qweight, scales, None, g_idx, group)
    torch.testing.assert_close(ref, reference.int4_matmul(x, qweight, scales, eights, g_idx, group))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    if m <= GEMV_MAX_TOKENS:
        config = GemvConfig(block_n=16, block_k=32, split_k=3)
        for kwargs in ({"activation": "silu"}, {"keep_splits": True}):
            sym = int4_gemv(x, qweight, scales, None, g_idx, group, config, **kwargs)  # type: ignore[arg-type]
            want = int4_gemv(x, qweight, scales, eights, g_idx, group, config, **kwargs)  # type: ignore[arg-type]
            torch.testing.assert_close(sym, want, rtol=0, atol=0)
