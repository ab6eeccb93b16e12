"""Grammar masks applied to the logits on the worker's device.

The core fills a step's packed bitmask (core/grammar.py) on its grammar thread; the worker
applies it right before sampling: numpy unpacking on CPU, one in-place Triton kernel on CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from asyncserve.core.step import GrammarBitmask


def apply_grammar_bitmask(
    logits: torch.Tensor, grammar: GrammarBitmask, sample_request_ids: Sequence[str]
) -> None:
    """Set to -inf, in place, the logits of tokens the grammar forbids in each constrained row.

    `logits` is [N, V] in `sample_request_ids` order; rows without a grammar are untouched.
    A request verifying proposals has consecutive rows under its id in both.
    """
    if list(grammar.request_ids) == list(sample_request_ids):
        apply_token_bitmask_(logits, grammar.bitmask, None)
        return
    position: dict[str, int] = {}
    for i, rid in enumerate(sample_request_ids):
        position.setdefault(rid, i)
    mask_rows: list[int] = []
    rows: list[int] = []
    seen: dict[str, int] = {}
    for i, rid in enumerate(grammar.request_ids):
        first = position.get(rid)
        if first is None:
            continue
        offset = seen.get(rid, 0)
        seen[rid] = offset + 1
        mask_rows.append(i)
        rows.append(first + offset)
    if not mask_rows:
        return
    bitmask = grammar.bitmask
    if len(mask_rows) != len(grammar.request_ids):
        bitmask = bitmask[mask_rows]
    apply_token_bitmask_(logits, bitmask, rows)


def apply_token_bitmask_(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None
) -> None:
    """Mask `logits[rows]` (all rows when None) with a packed [R, W] int32 host bitmask.

    On CPU the bits are unpacked with numpy (one pass over R * V bytes). On CUDA the packed
    words (V / 8 bytes a row) cross over from pinned memory without blocking and one Triton
    kernel writes -inf in place: no allocation, no sync with the forward still running.
    """
    if logits.device.type == "cpu":
        mask_logits_(logits, unpack_bitmask_numpy(bitmask, logits.shape[-1]), rows)
        return
    from asyncserve.kernels.bitmask import apply_token_bitmask_triton

    pin = logits.device.type == "cuda"
    device_rows = None
    if rows is not None:
        host_rows = torch.tensor(list(rows), dtype=torch.int64)
        device_rows = (host_rows.pin_memory() if pin else host_rows).to(
            logits.device, non_blocking=pin
        )
    device_mask = bitmask.to(logits.device, non_blocking=pin and bitmask.is_pinned())
    apply_token_bitmask_triton(logits, device_mask, device_rows)


def warm_up_grammar_kernel(device: torch.device) -> None:
    """Compile the mask kernel's two variants (all rows, chosen rows) at start-up: the first
    request with a grammar would otherwise stall its step, and every request in it, for the
    compile."""
    if device.type != "cuda":
        return
    logits = torch.zeros((2, 64), dtype=torch.float32, device=device)
    allowed = torch.full((2, 2), -1, dtype=torch.int32).pin_memory()
    apply_token_bitmask_(logits, allowed, None)
    apply_token_bitmask_(logits, allowed, [1, 0])


def mask_logits_(logits: torch.Tensor, allowed: torch.Tensor, rows: Sequence[int] | None) -> None:
    """-inf where `allowed` ([R, <= V] bool) is False, in `logits[rows]` (all rows when None).

    Columns past `allowed`'s width (ids beyond the tokenizer's vocabulary) are forbidden too.
    """
    width = allowed.shape[1]
    index: torch.Tensor | None = None
    target = logits
    if rows is not None:
        index = torch.tensor(list(rows), dtype=torch.int64).to(logits.device, non_blocking=True)
        target = logits.index_select(0, index)
    if logits.shape[-1] > width:
        target[:, width:] = float("-inf")
    # One pass, in place (faster than masked_fill_ with the negated mask).
    kept = target[:, :width]
    neg_inf = torch.tensor(float("-inf"), dtype=logits.dtype)  # 0-dim: a scalar on any device
    torch.where(allowed, kept, neg_inf, out=kept)
    if index is not None:
        logits.index_copy_(0, index, target)


def unpack_bitmask_numpy(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, W] int32 host bitmask -> [R, min(V, 32 W)] bool host tensor (little-endian words)."""
    packed = bitmask.contiguous().numpy().view(np.uint8)
    count = min(vocab, bitmask.shape[1] * 32)
    bits = np.unpackbits(packed, axis=1, count=count, bitorder="little")
    return torch.from_numpy(bits).view(torch.bool)
