"""Triton argmax over the vocabulary for a few rows (greedy decoding's pick).

torch's argmax reduces a row in one thread block: at batch 1 a 128k vocabulary's fp32
logits (0.5 MB) took 36 us on an H200, against the LM head's 250. Here each row is cut into
chunks of BLOCK columns, one program a chunk finds its maximum and where it is, and a second
pass picks the best chunk of each row. The result equals torch.argmax: the first index of
the maximum, and a NaN counts as larger than any number (the first NaN's index wins).
Reference: torch.argmax(dim=-1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Up to this many rows the two passes here; past it torch's kernel, which then has a block
# for each row.
MAX_ROWS = 64
_BLOCK = 4096


@triton.jit
def _chunk_argmax_kernel(
    x_ptr, best_ptr, where_ptr, n_cols, stride_row, chunks, BLOCK: tl.constexpr
):
    """best[row, chunk] / where[row, chunk]: the chunk's maximum (NaN if it has one) and the
    first column holding it."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_row + cols, mask=cols < n_cols, other=float("-inf"))
    x = x.to(tl.float32)
    is_nan = x != x
    first_nan = tl.min(tl.where(is_nan, cols, n_cols), axis=0)
    best, at = tl.max(tl.where(is_nan, float("-inf"), x), axis=0, return_indices=True,
                      return_indices_tie_break_left=True)  # fmt: skip
    found_nan = first_nan < n_cols
    out = row * chunks + chunk
    tl.store(best_ptr + out, tl.where(found_nan, float("nan"), best))
    tl.store(where_ptr + out, tl.where(found_nan, first_nan, chunk * BLOCK + at).to(tl.int64))


@triton.jit
def _row_argmax_kernel(best_ptr, where_ptr, out_ptr, chunks, BLOCK_C: tl.constexpr):
    """out[row]: the column of the row's best chunk (the first NaN chunk, else the first
    chunk holding the largest maximum)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    in_row = offs < chunks
    best = tl.load(best_ptr + row * chunks + offs, mask=in_row, other=float("-inf"))
    where = tl.load(where_ptr + row * chunks + offs, mask=in_row, other=0)
    is_nan = (best != best) & in_row
    first_nan = tl.min(tl.where(is_nan, offs, BLOCK_C), axis=0)
    _, top = tl.max(tl.where(is_nan, float("-inf"), best), axis=0, return_indices=True,
                    return_indices_tie_break_left=True)  # fmt: skip
    pick = tl.where(first_nan < BLOCK_C, first_nan, top)
    tl.store(out_ptr + row, tl.sum(tl.where(offs == pick, where, 0), axis=0))


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1): argmax_rows for up to MAX_ROWS rows on the GPU, torch's
    kernel past that and elsewhere."""
    if x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.shape[1] > 0:
        return argmax_rows(x)
    return x.argmax(dim=-1)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of a [rows, columns] tensor (columns > 0) by the two passes."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, n_cols = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    chunks = triton.cdiv(n_cols, _BLOCK)
    best = torch.empty((rows, chunks), dtype=torch.float32, device=x.device)
    where = torch.empty((rows, chunks), dtype=torch.int64, device=x.device)
    _chunk_argmax_kernel[(rows, chunks)](
        x, best, where, n_cols, x.stride(0), chunks, BLOCK=_BLOCK, num_warps=8
    )
    _row_argmax_kernel[(rows,)](
        best, where, out, chunks, BLOCK_C=triton.next_power_of_2(chunks), num_warps=1
    )
    return out
