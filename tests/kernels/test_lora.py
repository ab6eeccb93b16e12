"""LoRA shrink / expand (Triton, punica style) equal their references on mixed batches:
rows of several adapters, rows without one, padded ranks, a slice offset into a fused output."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncserve.kernels import reference

pytest.importorskip("triton", reason="triton is not installed")

from asyncserve.kernels.lora import lora_expand, lora_shrink  # noqa: E402
from asyncserve.lora.layers import LoRABatch  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def _groups(token_slots: list[int], num_slots: int, device: torch.device) -> LoRABatch:
    batch = LoRABatch(len(token_slots) + 8, num_slots, device)
    batch.set_rows(np.asarray(token_slots, dtype=np.int32))
    return batch


# A decode batch (one row each), a prefill mix (runs of one slot) and a batch without LoRA.
CASES = [
    [2, -1, 0, 2, 1, -1, 0],
    [1] * 21 + [-1] * 5 + [0] * 17 + [2] * 3,
    [-1, -1, -1],
    # A prefill-sized step (larger row blocks): runs of slots, some shorter than a block.
    [0] * 100 + [-1] * 90 + [2] * 7 + [1] * 120,
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("token_slots", CASES)
@pytest.mark.parametrize("k", [72, 520])  # 520: K split over programs (atomic sums)
def test_shrink_expand_match_reference(
    device: torch.device, dtype: torch.dtype, token_slots: list[int], k: int
) -> None:
    gen = torch.Generator().manual_seed(len(token_slots))
    num_slots, rank, width, offset, total = 3, 8, 40, 24, 80
    n = len(token_slots)
    x = torch.randn(n, k, generator=gen).to(dtype).to(device)
    lora_a = (0.2 * torch.randn(num_slots, rank, k, generator=gen)).to(dtype).to(device)
    lora_b = (0.2 * torch.randn(num_slots, width, rank, generator=gen)).to(dtype).to(device)
    lora_a[1, 5:] = 0  # slot 1 holds a rank-5 adapter, zero-padded to 8
    lora_b[1, :, 5:] = 0
    batch = _groups(token_slots, num_slots, device)
    args = (batch.sorted_tokens[:n], batch.group_slots, batch.group_starts)

    buf = torch.zeros(n, rank, dtype=torch.float32, device=device)
    buf_ref = torch.zeros_like(buf)
    lora_shrink(x, lora_a, *args, buf)
    reference.lora_shrink(x, lora_a, *args, buf_ref)
    torch.testing.assert_close(buf, buf_ref, atol=TOL[dtype], rtol=TOL[dtype])

    y0 = torch.randn(n, total, generator=gen).to(dtype).to(device)
    y, y_ref = y0.clone(), y0.clone()
    lora_expand(buf_ref, lora_b, *args, y, offset)
    reference.lora_expand(buf_ref, lora_b, *args, y_ref, offset)
    torch.testing.assert_close(y, y_ref, atol=TOL[dtype], rtol=TOL[dtype])
    # Columns outside the slice and rows without an adapter are untouched.
    no_lora = torch.tensor([s < 0 for s in token_slots], device=device)
    assert torch.equal(y[no_lora], y0[no_lora])
    assert torch.equal(y[:, :offset], y0[:, :offset])
    assert torch.equal(y[:, offset + width :], y0[:, offset + width :])


def test_reference_is_per_row_matmul() -> None:
    """The reference itself against the plain definition, row by row."""
    gen = torch.Generator().manual_seed(0)
    token_slots = [1, -1, 0, 1, 0]
    x = torch.randn(5, 16, generator=gen)
    lora_a = torch.randn(2, 4, 16, generator=gen)
    lora_b = torch.randn(2, 8, 4, generator=gen)
    batch = _groups(token_slots, 2, torch.device("cpu"))
    args = (batch.sorted_tokens[:5], batch.group_slots, batch.group_starts)
    buf = torch.zeros(5, 4)
    reference.lora_shrink(x, lora_a, *args, buf)
    y = torch.zeros(5, 8)
    reference.lora_expand(buf, lora_b, *args, y, 0)
    for row, slot in enumerate(token_slots):
        expected = torch.zeros(8) if slot < 0 else x[row] @ lora_a[slot].T @ lora_b[slot].T
        torch.testing.assert_close(y[row], expected, atol=1e-5, rtol=1e-5)
