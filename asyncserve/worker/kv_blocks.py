"""Copying whole KV blocks out of and into the paged pool (disaggregated prefill).

The layout on the wire is [blocks, layers, 2 (key, value), block_size, kv_heads, head_dim] in
the pool's dtype, on the CPU: what a consumer with the same model and block size writes back.
"""

from __future__ import annotations

import torch

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def read_blocks(kv_caches: KVCaches, block_ids: list[int]) -> torch.Tensor:
    if not kv_caches:
        raise RuntimeError("the KV pool is not allocated")
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0][0].device)
    per_layer = [torch.stack((k.index_select(0, index), v.index_select(0, index)), 1)
                 for k, v in kv_caches]  # fmt: skip
    return torch.stack(per_layer, 1).cpu()


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
    index = torch.tensor(block_ids, dtype=torch.long, device=key0.device)
    data = data.to(key0.device)
    for layer, (k, v) in enumerate(kv_caches):
        k.index_copy_(0, index, data[:, layer, 0])
        v.index_copy_(0, index, data[:, layer, 1])
    if key0.is_cuda:
        torch.cuda.current_stream(key0.device).synchronize()  # written before any step reads
