"""The int4 GEMV (decode) equals quant_reference: one to four tokens, group sizes 32 to 128
and larger than a step, asymmetric zeros, ragged N, K of one group, the split-K reduction
(even and ragged splits), per-column groups (g_idx, odd group sizes), and act order made
contiguous by the layer. Under Triton's interpreter on CPU, so the shapes are tiny."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from asyncserve.kernels import quant_reference as reference

pytest.importorskip("triton", reason="triton is not installed")

from asyncserve.kernels.int4_gemm import int4_matmul  # noqa: E402
from asyncserve.kernels.int4_gemv import GemvConfig, gemv_config, int4_gemv  # noqa: E402
from asyncserve.kernels.split_k import prefetch_lines  # noqa: E402
from asyncserve.quantization.int4 import GPTQLinearMethod  # noqa: E402

Weight = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _weight(n: int, k: int, group: int, device: torch.device, seed: int = 0) -> Weight:
    """(values [N, K], qweight, scales, zeros): random nibbles, asymmetric zeros."""
    g = torch.Generator().manual_seed(seed + n * k + group)
    values = torch.randint(0, 16, (n, k), generator=g)
    groups = -(-k // group)
    scales = torch.rand(n, groups, generator=g) * 0.02 + 0.001
    zeros = torch.randint(0, 16, (n, groups), generator=g).float()
    return values, reference.pack_int4(values).to(device), scales.to(device), zeros.to(device)


def _x(m: int, k: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(m + k)).to(device, dtype)


def _check(out: torch.Tensor, ref: torch.Tensor) -> None:
    tol = 1e-4 if out.dtype == torch.float32 else 2e-2
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_matches_reference(
    device: torch.device, m: int, group: int, dtype: torch.dtype
) -> None:
    """N = 40 is not a multiple of the 32-output blocks; two steps of two groups each."""
    n, k = 40, 4 * group
    _, qweight, scales, zeros = _weight(n, k, group, device)
    scales, zeros = scales.to(dtype), zeros.to(dtype)
    x = _x(m, k, dtype, device)
    config = GemvConfig(block_n=32, block_k=2 * group, split_k=1)
    out = int4_gemv(x, qweight, scales, zeros, None, group, config)
    _check(out, reference.int4_matmul(x, qweight, scales, zeros, None, group))


@pytest.mark.parametrize(
    ("k", "group", "block_k", "split_k"),
    [
        (64, 64, 64, 1),  # K of one group
        (256, 32, 64, 2),  # split-K: two splits of two steps
        (384, 64, 64, 3),  # three splits
        (320, 32, 64, 3),  # five steps in splits of two: the last one short
        (96, 32, 64, 1),  # K not a multiple of the step (ragged tail)
        (512, 128, 64, 2),  # groups larger than a step: a step is half a group
        (2048, 128, 1024, 2),  # the default step on 8B shapes: eight groups a step
        (4096, 128, 2048, 2),  # sixteen groups a step (the tile sweep's widest)
    ],
)
@pytest.mark.parametrize("num_stages", [1, 3])  # 3: the loop's loads pipelined (GPU)
def test_gemv_steps_and_splits(
    device: torch.device, k: int, group: int, block_k: int, split_k: int, num_stages: int
) -> None:
    _, qweight, scales, zeros = _weight(24, k, group, device)
    for m in (1, 3):
        x = _x(m, k, torch.float32, device)
        config = GemvConfig(16, block_k, split_k, num_stages=num_stages)
        out = int4_gemv(x, qweight, scales, zeros, None, group, config)
        _check(out, reference.int4_matmul(x, qweight, scales, zeros, None, group))


@pytest.mark.parametrize("g_idx", [False, True])
def test_gemv_nibble_extremes_exact(device: torch.device, g_idx: bool) -> None:
    """Words of all 0s, all 15s and mixed, scale 1 and zero 0: every nibble position read
    exactly, on the whole-group path and the per-column one; x of powers of two so the fp32
    sums are exact too."""
    n, k, group = 16, 64, 32
    values = torch.zeros(n, k, dtype=torch.long)
    values[1] = 15
    values[2, ::2] = 15
    values[3:] = torch.arange(k) % 16
    qweight = reference.pack_int4(values).to(device)
    scales = torch.ones(n, k // group, device=device)
    zeros = torch.zeros(n, k // group, device=device)
    index = (torch.arange(k) // group).int().to(device) if g_idx else None
    x = (2.0 ** (torch.arange(k) % 8 - 4)).reshape(1, k).to(device)
    out = int4_gemv(x, qweight, scales, zeros, index, group, GemvConfig(16, 32, 1))
    assert torch.equal(out.cpu(), (x.cpu() @ values.float().t()))


def test_gemv_per_column_groups(device: torch.device) -> None:
    """A g_idx (a row-parallel rank's act-order slice, split over K) and a group size that
    is not a power of two read a scale and zero per column."""
    n, k = 24, 96
    _, qweight, scales, zeros = _weight(n, k, 32, device)
    g_idx = (torch.randperm(k, generator=torch.Generator().manual_seed(1)) // 32).int()
    g_idx = g_idx.to(device)
    x = _x(2, k, torch.float32, device)
    config = GemvConfig(block_n=16, block_k=32, split_k=2)
    out = int4_gemv(x, qweight, scales, zeros, g_idx, 32, config)
    _check(out, reference.int4_matmul(x, qweight, scales, zeros, g_idx, 32))
    _, qweight, scales, zeros = _weight(n, k, 24, device)  # groups of 24: 4 of them
    out = int4_gemv(x, qweight, scales, zeros, None, 24)
    _check(out, reference.int4_matmul(x, qweight, scales, zeros, None, 24))


def _act_order_layer(n: int, group: int, g_idx: torch.Tensor, groups: int) -> nn.Module:
    """A GPTQ act-order layer over len(g_idx) input columns, after loading; the reference
    tensors (unsorted) in layer.reference."""
    g = torch.Generator().manual_seed(4)
    values = torch.randint(0, 16, (n, g_idx.numel()), generator=g)
    scales = torch.rand(n, groups, generator=g) * 0.02 + 0.001
    zeros = torch.randint(0, 16, (n, groups), generator=g).float()
    layer = nn.Module()
    method = GPTQLinearMethod(group, desc_act=True, zeros_minus_one=False)
    method.set_layout(layer, values, scales, zeros, g_idx, ())
    layer.quant_method = method
    layer.reference = (reference.pack_int4(values), scales, zeros)
    return layer


def test_act_order_layer_sorts_groups(device: torch.device) -> None:
    """A whole layer's act-order g_idx: the layer stores its columns sorted by group (no
    g_idx left), permutes x, and the kernels and the CPU path equal the reference."""
    n, k, group = 40, 128, 32
    g_idx = (torch.randperm(k, generator=torch.Generator().manual_seed(2)) // group).int()
    layer = _act_order_layer(n, group, g_idx, k // group)
    assert layer.w4_g_idx is None and layer.w4_perm is not None
    qweight, scales, zeros = layer.reference
    for m in (1, 4, 9):  # the GEMV and the GEMM
        x = _x(m, k, torch.float32, torch.device("cpu"))
        ref = reference.int4_matmul(x, qweight, scales, zeros, g_idx, group)
        # The CPU path of the layer.
        _check(layer.quant_method.apply(layer, x, None), ref)
        # The kernels, as apply() calls them on CUDA.
        x_sorted = x.index_select(1, layer.w4_perm).to(device)
        out = int4_matmul(
            x_sorted, layer.w4_qweight.to(device), scales.to(device), zeros.to(device), None, group
        )
        _check(out.cpu(), ref)


def test_act_order_rank_slice_keeps_g_idx() -> None:
    """A rank's half of the columns draws a varying number from each group: not sortable
    into whole groups, so the layer keeps the g_idx (the per-column path)."""
    g_idx = (torch.randperm(128, generator=torch.Generator().manual_seed(3)) // 32).int()
    layer = _act_order_layer(40, 32, g_idx[64:], 4)
    assert layer.w4_perm is None
    assert torch.equal(layer.w4_g_idx, g_idx[64:])


def test_gemv_config_for_llama_3_8b() -> None:
    """Every layer of an 8B model gets at least 3 programs per SM of an H100 (132 SMs), in
    splits that divide K's steps evenly."""
    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]:
        config = gemv_config(n, k, 128, False, 132)
        steps = k // config.block_k
        assert config.block_k % 128 == 0 and steps % config.split_k == 0
        assert -(-n // config.block_n) * config.split_k >= 3 * 132
    assert gemv_config(4096, 14336, 128, False, 132).split_k == 7
    # The tile the H100 sweep found fastest on all four shapes.
    assert (
        gemv_config(4096, 4096, 128, False, 132).block_n,
        gemv_config(4096, 4096, 128, False, 132).block_k,
    ) == (16, 1024)
    assert gemv_config(28672, 4096, 128, False, 132).split_k == 1


@pytest.mark.parametrize("lines", [0, 3, 64])
def test_gemv_prefetch_depths_give_the_same_result(device: torch.device, lines: int) -> None:
    """How many weight lines a program prefetches before its PDL wait (none, a count rounded
    up to a power of two, more than its K slice) changes no value; split K slices clamp it."""
    n, k, group = 40, 512, 64
    _, qweight, scales, zeros = _weight(n, k, group, device)
    x = _x(2, k, torch.float32, device)
    base = GemvConfig(block_n=16, block_k=128, split_k=2)
    want = int4_gemv(x, qweight, scales, zeros, None, group, base)
    config = GemvConfig(block_n=16, block_k=128, split_k=2, prefetch_lines=lines)
    out = int4_gemv(x, qweight, scales, zeros, None, group, config)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_prefetch_lines() -> None:
    assert prefetch_lines(GemvConfig(16, 1024, 1), 4) == 4  # the kernel's default
    assert prefetch_lines(GemvConfig(16, 1024, 1, prefetch_lines=0), 4) == 0
    assert prefetch_lines(GemvConfig(16, 1024, 1, prefetch_lines=3), 4) == 4
    assert prefetch_lines(GemvConfig(16, 1024, 1, prefetch_lines=16), 4) == 16


@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize(("m", "d", "g_idx"), [(1, 24, False), (3, 40, False), (2, 24, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_gemv_equals_gemv_then_activation(
    device: torch.device, activation: str, m: int, d: int, g_idx: bool, dtype: torch.dtype
) -> None:
    """act(gate) * up from one kernel equals the GEMV's [M, 2d] output through the activation
    kernel, value for value (ragged output blocks: d = 24 and 40 against 8 a program;
    per-column groups with a g_idx)."""
    from asyncserve.kernels.activation import gelu_tanh_and_mul, silu_and_mul

    group, k = 32, 128
    _, qweight, scales, zeros = _weight(2 * d, k, group, device, seed=m)
    scales, zeros = scales.to(dtype), zeros.to(dtype)
    gidx = None
    if g_idx:
        gidx = (torch.randperm(k, generator=torch.Generator().manual_seed(d)) // group).to(
            device, torch.int32
        )
    x = _x(m, k, dtype, device)
    config = GemvConfig(block_n=16, block_k=64, split_k=2)  # the gated GEMV takes one split
    unfused = int4_gemv(x, qweight, scales, zeros, gidx, group, GemvConfig(16, 64, 1))
    act_and_mul = silu_and_mul if activation == "silu" else gelu_tanh_and_mul
    fused = int4_gemv(x, qweight, scales, zeros, gidx, group, config, activation=activation)
    assert fused.shape == (m, d) and fused.dtype == dtype
    torch.testing.assert_close(fused, act_and_mul(unfused), rtol=0, atol=0)
    dense = reference.int4_matmul(x.float(), qweight, scales.float(), zeros.float(), gidx, group)
    ref = act_and_mul(dense).to(dtype)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(fused, ref, rtol=tol, atol=tol)


def test_gated_gemv_needs_even_rows(device: torch.device) -> None:
    _, qweight, scales, zeros = _weight(9, 64, 32, device)
    with pytest.raises(ValueError, match="even number of rows"):
        int4_gemv(_x(1, 64, torch.float32, device), qweight, scales, zeros, None, 32, None, "silu")


@pytest.mark.parametrize("split_k", [1, 3])
def test_gemv_keeps_its_splits(device: torch.device, split_k: int) -> None:
    """keep_splits returns the fp32 parts [splits, M, N] that the summed result adds."""
    from asyncserve.kernels.split_k import sum_splits

    _, qweight, scales, zeros = _weight(40, 384, 32, device)
    x = _x(2, 384, torch.bfloat16, device)
    scales, zeros = scales.bfloat16(), zeros.bfloat16()
    config = GemvConfig(block_n=16, block_k=64, split_k=split_k)
    parts = int4_gemv(x, qweight, scales, zeros, None, 32, config, keep_splits=True)
    assert parts.shape == (split_k, 2, 40) and parts.dtype == torch.float32
    summed = torch.empty((2, 40), dtype=torch.bfloat16, device=device)
    sum_splits(parts, summed)
    assert torch.equal(summed, int4_gemv(x, qweight, scales, zeros, None, 32, config))
