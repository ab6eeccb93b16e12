"""apply_token_bitmask_triton equals the host path (numpy unpack + masking)."""

from __future__ import annotations

import pytest
import torch

from asyncserve.worker.grammar_mask import mask_logits_, unpack_bitmask_numpy

pytest.importorskip("triton", reason="triton is not installed")

from asyncserve.kernels.bitmask import apply_token_bitmask_triton  # noqa: E402


@pytest.mark.parametrize(
    ("dtype", "vocab", "num_words", "rows"),
    [
        (torch.float32, 100, 4, None),  # every row constrained, masked tail of the last block
        (torch.bfloat16, 2500, 79, [4, 1, 2]),  # some rows, out of order, several blocks
        (torch.float16, 200, 5, [0]),  # logits wider than the mask: ids past it forbidden
    ],
)
def test_bitmask_kernel_matches_host_path(
    device: torch.device,
    dtype: torch.dtype,
    vocab: int,
    num_words: int,
    rows: list[int] | None,
) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen).to(dtype)
    num_mask_rows = len(rows) if rows is not None else logits.shape[0]
    bitmask = torch.randint(
        -(2**31), 2**31 - 1, (num_mask_rows, num_words), dtype=torch.int32, generator=gen
    )
    expected = logits.clone()
    mask_logits_(expected, unpack_bitmask_numpy(bitmask, vocab), rows)
    out = logits.to(device)
    row_index = torch.tensor(rows, device=device) if rows is not None else None
    apply_token_bitmask_triton(out, bitmask.to(device), row_index)
    assert torch.equal(out.cpu(), expected)
