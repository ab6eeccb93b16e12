"""Copying whole KV blocks out of and into the paged pool (disaggregated prefill).

The layout on the wire is [blocks, layers, 2 (key, value), block_size, kv_heads, head_dim] in
the pool's dtype, on the CPU, with the whole model's KV heads whatever the tensor-parallel
size: a rank reads its own heads' slice (read_blocks), the engine joins the ranks' slices
(merge_rank_heads), and each rank of the receiving instance writes the heads it holds
(rank_heads, write_blocks). So a producer and a consumer may split the heads differently.
"""

from __future__ import annotations

from typing import Any

import torch

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
_HEADS_DIM = 4


def read_blocks(kv_caches: KVCaches, block_ids: list[int]) -> torch.Tensor:
    return _gather(kv_caches, block_ids).cpu()


def read_blocks_on_device(kv_caches: KVCaches, block_ids: list[int]) -> tuple[torch.Tensor, Any]:
    """The blocks on the pool's device, and a CUDA event recorded once they are gathered
    (another stream waits on it before it reads them); None on the CPU."""
    data = _gather(kv_caches, block_ids)
    if not data.is_cuda:
        return data, None
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(data.device))
    return data, ready


def _gather(kv_caches: KVCaches, block_ids: list[int]) -> torch.Tensor:
    if not kv_caches:
        raise RuntimeError("the KV pool is not allocated")
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0][0].device)
    per_layer = [torch.stack((k.index_select(0, index), v.index_select(0, index)), 1)
                 for k, v in kv_caches]  # fmt: skip
    return torch.stack(per_layer, 1)


def merge_rank_heads(parts: list[torch.Tensor], num_kv_heads: int) -> torch.Tensor:
    """The ranks' slices (read_blocks of each, in rank order) as the whole model's heads.
    With fewer KV heads than ranks each head is on several ranks: its first one gives it."""
    size = len(parts)
    if size == 1:
        return parts[0]
    if num_kv_heads >= size:
        return torch.cat(parts, dim=_HEADS_DIM)
    # Rank r holds head r * num_kv_heads // size (models/parallel.py, kv_heads).
    return torch.cat([parts[h * size // num_kv_heads] for h in range(num_kv_heads)], _HEADS_DIM)


def rank_heads(data: torch.Tensor, first: int, count: int, num_kv_heads: int) -> torch.Tensor:
    """This rank's heads [first, first + count) of blocks carrying all `num_kv_heads`."""
    if data.dim() != 6 or data.shape[_HEADS_DIM] != num_kv_heads:
        raise ValueError(
            f"KV blocks of shape {tuple(data.shape)} do not carry this model's {num_kv_heads} "
            "KV heads: the two instances must serve the same model"
        )
    if count == num_kv_heads:
        return data
    return data.narrow(_HEADS_DIM, first, count)


def write_blocks(kv_caches: KVCaches, block_ids: list[int], data: torch.Tensor) -> None:
    if not kv_caches:
        raise RuntimeError("the KV pool is not allocated")
    key0 = kv_caches[0][0]
    expected = (len(block_ids), len(kv_caches), 2, *key0.shape[1:])
    if tuple(data.shape) != expected or data.dtype != key0.dtype:
        raise ValueError(
            f"KV blocks of shape {tuple(data.shape)} {data.dtype} do not fit this pool "
            f"({expected} {key0.dtype}): the two instances must serve the same model with the "
            "same block size and dtype"
        )
    index, data = _to_pool(block_ids, data, key0.device)
    for layer, (k, v) in enumerate(kv_caches):
        k.index_copy_(0, index, data[:, layer, 0])
        v.index_copy_(0, index, data[:, layer, 1])
    # No synchronize on CUDA: the copies are queued on the current stream, which every later
    # step runs on, so stream order puts them before any read of these blocks.


def _to_pool(
    block_ids: list[int], data: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The index and the blocks on the pool's device, without blocking the host on CUDA."""
    if device.type != "cuda":
        return torch.tensor(block_ids, dtype=torch.long, device=device), data.to(device)
    if data.is_cuda:
        # It may come from another stream (the KV group's receive, which the host waited
        # for): its memory is not reused before this stream's copies of it ran.
        data.record_stream(torch.cuda.current_stream(data.device))
    else:
        # Pinned, so the copy is queued without waiting for the stream.
        data = torch.empty(data.shape, dtype=data.dtype, pin_memory=True).copy_(data)
    index = torch.tensor(block_ids, dtype=torch.long, pin_memory=True)
    index = index.to(device, non_blocking=True)
    return index, data.to(device, non_blocking=True)


def write_rank_blocks(
    kv_caches: KVCaches,
    block_ids: list[int],
    data: torch.Tensor,
    heads: tuple[int, int],
    num_kv_heads: int,
) -> str | None:
    """A rank's write of blocks carrying all the KV heads (its `heads`: first, count); the
    reason when they do not fit, nothing written (an error would end a tensor-parallel
    engine: every rank finds the same reason instead)."""
    try:
        write_blocks(kv_caches, block_ids, rank_heads(data, *heads, num_kv_heads))
    except ValueError as exc:
        return str(exc)
    return None
