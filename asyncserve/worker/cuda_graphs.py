"""CUDA graphs for pure-decode steps, one per padded batch size, all captured at start-up.

A decode step launches hundreds of small kernels; replaying one graph removes the launch
overhead that otherwise bounds small batches. Inputs live in persistent buffers the graph
reads; a batch is padded up to the nearest captured size (padding rows store no K/V).
Capturing every size before serving keeps kernel compiles and captures out of the requests'
time (a size first met while serving stalled every running request for its compile), and
out of the way of threads that use the device beside the steps (KV transfers).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from asyncserve.models.attention import AttentionMetadata
from asyncserve.models.base import CausalLM
from asyncserve.worker.input_batch import StepInputs

logger = logging.getLogger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch + 16, 16))
    return sorted({min(s, max_batch) for s in sizes})


def padded_batch_size(sizes: list[int], num_reqs: int) -> int | None:
    """The smallest captured size that holds `num_reqs` rows; None past the largest."""
    return next((size for size in sizes if size >= num_reqs), None)


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_batch: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.max_model_len = max_model_len
        self.device = device
        max_blocks = -(-max_model_len // block_size)
        n = self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((n, max_blocks), dtype=torch.int32, device=device)
        # Every row is one query token: cumulative lengths are 0, 1, 2, ...
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool: Any = None

    def padded_size(self, num_reqs: int) -> int | None:
        return padded_batch_size(self.sizes, num_reqs)

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            cu_seqlens_q=self.cu_seqlens_q[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            max_seqlen_q=1,
            # An upper bound fixes the kernel's grid; the kernel reads each true length.
            max_seqlen_k=self.max_model_len,
        )

    def _forward(self, size: int) -> torch.Tensor:
        hidden = self.model(
            self.input_ids[:size], self.positions[:size], self.kv_caches, self._meta(size)
        )
        # This rank's vocabulary slice: the gather to the driver runs after the replay.
        return self.model.local_logits(hidden)

    def _capture(self, size: int) -> None:
        start = time.perf_counter()
        # Padding values while capturing: nothing is written to the KV cache.
        self.slot_mapping[:size].fill_(-1)
        self.seq_lens[:size].fill_(1)
        self._forward(size)  # compiles the kernels outside the capture
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        # thread_local: another thread's device calls (a KV transfer) leave the capture valid.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            logits = self._forward(size)
        self.graphs[size] = (graph, logits)
        logger.debug(
            "captured decode graph for batch %d in %.3f s", size, time.perf_counter() - start
        )

    def capture_all(self) -> None:
        """Every size, largest first (the smaller graphs reuse the largest one's pool)."""
        start = time.perf_counter()
        for size in reversed(self.sizes):
            if size not in self.graphs:
                self._capture(size)
        logger.info(
            "captured %d decode graphs (batch 1 to %d) in %.1f s",
            len(self.sizes), self.max_batch, time.perf_counter() - start,
        )  # fmt: skip

    def run(self, inputs: StepInputs, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [num_reqs, this rank's vocabulary slice] of a pure-decode step, by graph
        replay; `positions` replaces the step's (M-RoPE models: index + delta)."""
        n = len(inputs.request_ids)
        size = self.padded_size(n)
        assert size is not None
        if size not in self.graphs:
            self._capture(size)
        meta = inputs.meta
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(inputs.input_ids)
        self.positions[:n].copy_(inputs.positions if positions is None else positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        if size > n:
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(1)
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:n]
