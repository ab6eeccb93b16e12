"""Triton: forbid, in place, the logits of tokens a packed grammar bitmask excludes.

One pass over the constrained rows: each program reads 32-bit mask words and writes -inf
only where a bit is 0, so a step with grammars allocates nothing and launches one kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# Shapes are not specialized on: the start-up warm-up (worker/grammar_mask.py) compiles the
# two variants once, with any vocabulary size.
@triton.jit(do_not_specialize=["vocab", "num_words", "stride_logits_row", "stride_mask_row"])
def _apply_bitmask_kernel(
    logits_ptr,  # [N, V]
    bitmask_ptr,  # [R, W] int32, bit t % 32 of word t // 32 set = token t allowed
    rows_ptr,  # [R] int64: the logits row of each mask row (read when HAS_ROWS)
    vocab,  # V
    num_words,  # W
    stride_logits_row,
    stride_mask_row,
    HAS_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,  # tokens per program
):
    mask_row = tl.program_id(0).to(tl.int64)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = tokens < vocab
    words = tokens // 32
    # Tokens past the mask's width (ids beyond the tokenizer's vocabulary) stay forbidden.
    has_word = in_vocab & (words < num_words)
    word = tl.load(bitmask_ptr + mask_row * stride_mask_row + words, mask=has_word, other=0)
    allowed = ((word >> (tokens % 32)) & 1) != 0
    if HAS_ROWS:
        row = tl.load(rows_ptr + mask_row)
    else:
        row = mask_row
    neg_inf = tl.full([BLOCK], float("-inf"), dtype=logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_logits_row + tokens, neg_inf, mask=in_vocab & ~allowed)


def apply_token_bitmask_triton(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None
) -> None:
    """-inf in `logits[rows[i]]` (row i when rows is None) where `bitmask[i]` has a 0 bit.

    `logits` [N, V] and `bitmask` [R, W] int32 (and `rows` [R] int64) on the same device.
    """
    if logits.stride(-1) != 1:
        raise ValueError("logits must be contiguous in the vocabulary dimension")
    num_rows, num_words = bitmask.shape
    if num_rows == 0:
        return
    vocab = logits.shape[-1]
    block = 1024
    grid = (num_rows, triton.cdiv(vocab, block))
    _apply_bitmask_kernel[grid](
        logits,  # [N, V]
        bitmask,  # [R, W]
        rows if rows is not None else bitmask,  # rows_ptr (unused without rows)
        vocab,  # vocab
        num_words,  # num_words
        logits.stride(0),  # stride_logits_row
        bitmask.stride(0),  # stride_mask_row
        HAS_ROWS=rows is not None,
        BLOCK=block,
        num_warps=4,
    )
