"""What the draft-model and EAGLE proposers share: a small paged KV cache of their own and,
per request, how far its draft K/V are written and the distributions its last proposals
were drawn from."""

from __future__ import annotations

import torch

from asyncserve.models.arch_config import ArchConfig
from asyncserve.worker.input_batch import CachedRequestState
from asyncserve.worker.kv_pool import allocate_kv_caches, kv_block_bytes


class ModelProposer:
    arch: ArchConfig
    block_size: int
    dtype: torch.dtype
    device: torch.device

    def __init__(self) -> None:
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Request id -> (its runner state, positions whose draft K/V are written). A
        # request that comes back (preemption) has a new state and starts over.
        self._progress: dict[str, tuple[CachedRequestState, int]] = {}
        # Request id -> [k, V] distributions its last proposals were drawn from (random
        # rows only; greedy rows need none).
        self._probs: dict[str, torch.Tensor] = {}

    def block_bytes(self) -> int:
        return kv_block_bytes(self.arch, self.block_size, self.dtype)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_caches(
            self.arch, num_blocks, self.block_size, self.dtype, self.device
        )

    def forget(self, request_id: str) -> None:
        self._progress.pop(request_id, None)
        self._probs.pop(request_id, None)

    def draft_probs(self, request_id: str, num_drafts: int) -> torch.Tensor | None:
        probs = self._probs.get(request_id)
        return None if probs is None else probs[:num_drafts]
