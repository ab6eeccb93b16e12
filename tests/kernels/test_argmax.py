"""The two-pass argmax (kernels/argmax.py) equals torch.argmax: first index of the maximum,
NaN above every number, -inf rows, ragged last chunks, rows of one chunk and of many."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from asyncserve.kernels import reference  # noqa: E402
from asyncserve.kernels.argmax import MAX_ROWS, argmax, argmax_rows  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "cols"), [(1, 10000), (3, 4096), (2, 12289), (5, 100)])
def test_argmax_rows_equals_torch(
    device: torch.device, dtype: torch.dtype, rows: int, cols: int
) -> None:
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(cols)).to(dtype)
    x[0, cols // 2] = 50.0
    x = x.to(device)
    assert torch.equal(argmax_rows(x).cpu(), reference.argmax(x.cpu().float()))


def test_ties_nan_and_minus_inf(device: torch.device) -> None:
    cols = 9000  # three chunks, the last ragged
    x = torch.zeros(5, cols)
    x[0, [17, 4100, 8999]] = 3.0  # a tie across chunks: the first
    x[1, [5000, 5001]] = 2.0  # a tie inside a chunk
    x[2, [8000, 300]] = float("nan")  # NaN wins, the first one
    x[2, 10] = float("inf")
    x[3] = float("-inf")  # all -inf: index 0
    x[4, 8998] = float("inf")
    x = x.to(device)
    want = torch.tensor([17, 5000, 300, 0, 8998])
    assert torch.equal(argmax_rows(x).cpu(), want)
    assert torch.equal(x.cpu().argmax(dim=-1), want)  # what torch does


def test_strided_rows(device: torch.device) -> None:
    wide = torch.randn(3, 6000, generator=torch.Generator().manual_seed(1)).to(device)
    x = wide[:, 1000:5000]
    assert torch.equal(argmax_rows(x).cpu(), x.cpu().argmax(dim=-1))


def test_dispatch_keeps_torch_off_the_gpu_and_for_many_rows() -> None:
    x = torch.randn(MAX_ROWS + 1, 50)
    assert torch.equal(argmax(x), x.argmax(dim=-1))
    assert argmax(torch.randn(0, 5)).shape == (0,)
