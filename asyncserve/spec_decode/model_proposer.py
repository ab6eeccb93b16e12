"""What the draft-model and EAGLE proposers share: a small paged KV cache of their own,
per request how far its draft K/V are written and the distributions its last proposals
were drawn from, and the one-token proposal steps, which replay CUDA graphs of the
proposer's forward where there are any (worker/cuda_graphs.py, as the target's decode
steps; the first, catch-up step of a round has many tokens per request and runs eagerly)."""

from __future__ import annotations

import numpy as np
import torch

from asyncserve.models.arch_config import ArchConfig
from asyncserve.models.attention import AttentionMetadata
from asyncserve.worker.cuda_graphs import DecodeGraphs
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
        self.graphs: DecodeGraphs | None = None

    def block_bytes(self) -> int:
        return kv_block_bytes(self.arch, self.block_size, self.dtype)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_caches(
            self.arch, num_blocks, self.block_size, self.dtype, self.device
        )

    def use_cuda_graphs(self, max_batch: int, max_model_len: int) -> None:
        """Run the one-token proposal steps of up to `max_batch` requests as graphs."""
        self.graphs = DecodeGraphs(
            self._decode_forward, max_batch, max_model_len, self.block_size, self.device
        )

    def _decode_forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, ...]:
        """The one-token forward a graph captures: (logits, ...) with a row per request."""
        raise NotImplementedError

    def _one_token_inputs(
        self, positions: list[int], block_tables: torch.Tensor
    ) -> tuple[torch.Tensor, AttentionMetadata, DecodeGraphs | None]:
        """A one-token step at each request's position: its positions, its attention
        metadata, and the graphs that replay it (None: it runs eagerly)."""
        pos_t, meta, _ = self._layout(positions, [p + 1 for p in positions], block_tables)
        graphs = self.graphs
        if graphs is None or not graphs.fits(len(positions), block_tables.shape[1]):
            return pos_t, meta, None
        return pos_t, meta, graphs

    def forget(self, request_id: str) -> None:
        self._progress.pop(request_id, None)
        self._probs.pop(request_id, None)

    def draft_probs(self, request_id: str, num_drafts: int) -> torch.Tensor | None:
        probs = self._probs.get(request_id)
        return None if probs is None else probs[:num_drafts]

    def _layout(
        self, starts: list[int], ends: list[int], block_tables: torch.Tensor
    ) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Positions [start, end) of each request, flattened: (positions, attention
        metadata over the proposer's own KV cache, index of each request's last row)."""
        counts = np.asarray(ends, dtype=np.int64) - np.asarray(starts, dtype=np.int64)
        cu = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=cu[1:])
        positions = np.arange(cu[-1], dtype=np.int64) - np.repeat(cu[:-1], counts)
        positions += np.repeat(np.asarray(starts, dtype=np.int64), counts)
        req_index = np.repeat(np.arange(len(counts)), counts)
        device = self.device
        pos_t = torch.from_numpy(positions).to(device)
        req_t = torch.from_numpy(req_index).to(device)
        blocks = block_tables[req_t, pos_t // self.block_size].to(torch.int64)
        meta = AttentionMetadata(
            slot_mapping=blocks * self.block_size + pos_t % self.block_size,
            cu_seqlens_q=torch.from_numpy(cu).to(device, torch.int32),
            seq_lens=torch.tensor(ends, dtype=torch.int32).to(device),
            block_tables=block_tables,
            max_seqlen_q=int(counts.max()),
            max_seqlen_k=max(ends),
        )
        return pos_t, meta, torch.from_numpy(cu[1:] - 1).to(device)
