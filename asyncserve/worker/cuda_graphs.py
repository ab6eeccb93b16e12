"""CUDA graphs for pure-decode steps, one per padded batch size, all captured at start-up.

A decode step launches hundreds of small kernels; replaying one graph removes the launch
overhead that otherwise bounds small batches. Inputs live in persistent buffers the graph
reads; a batch is padded up to the nearest captured size (padding rows store no K/V).
Capturing every size before serving keeps kernel compiles and captures out of the requests'
time (a size first met while serving stalled every running request for its compile), and
out of the way of threads that use the device beside the steps (KV transfers).
The same machinery serves the target model's decode steps and a proposer's one-token
steps (draft model or EAGLE head): each passes the forward to capture.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from asyncserve.models.attention import AttentionMetadata
from asyncserve.models.base import CausalLM
from asyncserve.worker.input_batch import StepInputs

logger = logging.getLogger(__name__)

# One token per row: (input_ids [n], positions [n], attention metadata) -> the step's
# outputs, each with the batch first (the logits first).
DecodeForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], tuple[torch.Tensor, ...]]


def logits_forward(
    model: CausalLM,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    to_logits: Callable[[torch.Tensor], torch.Tensor],
) -> DecodeForward:
    """A model's decode forward whose one output is `to_logits` of its hidden states."""

    def forward(
        input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, ...]:
        return (to_logits(model(input_ids, positions, kv_caches, meta)),)

    return forward


def capture_sizes(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch + 16, 16))
    return sorted({min(s, max_batch) for s in sizes})


def padded_batch_size(sizes: list[int], num_reqs: int) -> int | None:
    """The smallest captured size that holds `num_reqs` rows; None past the largest."""
    return next((size for size in sizes if size >= num_reqs), None)


class DecodeGraphs:
    def __init__(
        self,
        forward: DecodeForward,
        max_batch: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.forward = forward
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
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        self.pool: Any = None

    def padded_size(self, num_reqs: int) -> int | None:
        return padded_batch_size(self.sizes, num_reqs)

    def fits(self, num_reqs: int, table_width: int) -> bool:
        """Whether a step of `num_reqs` rows with block tables `table_width` wide can replay."""
        return self.padded_size(num_reqs) is not None and table_width <= self.block_tables.shape[1]

    def inputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The buffers a graph of `size` rows reads: the forward's arguments."""
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            cu_seqlens_q=self.cu_seqlens_q[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            max_seqlen_q=1,
            # An upper bound fixes the kernel's grid; the kernel reads each true length.
            max_seqlen_k=self.max_model_len,
        )
        return self.input_ids[:size], self.positions[:size], meta

    def _capture(self, size: int) -> None:
        start = time.perf_counter()
        # Padding values while capturing: nothing is written to the KV cache.
        self.slot_mapping[:size].fill_(-1)
        self.seq_lens[:size].fill_(1)
        self.forward(*self.inputs(size))  # compiles the kernels outside the capture
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        # thread_local: another thread's device calls (a KV transfer) leave the capture valid.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            outputs = self.forward(*self.inputs(size))
        self.graphs[size] = (graph, outputs)
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
        positions = inputs.positions if positions is None else positions
        return self.replay(inputs.input_ids, positions, inputs.meta)[0]

    def replay(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, ...]:
        """The forward's outputs for one token per row, by graph replay. They are the
        graph's own buffers: read them before the next replay of this object."""
        n = input_ids.shape[0]
        size = self.padded_size(n)
        assert size is not None
        # Capturing runs on padding values, so the step's inputs go in after it.
        if size not in self.graphs:
            self._capture(size)
        self.fill(input_ids, positions, meta)
        graph, outputs = self.graphs[size]
        graph.replay()
        return tuple(output[:n] for output in outputs)

    def fill(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> int:
        """Copy a step into the input buffers, padded to its captured size (returned):
        padding rows write no K/V and attend to one position."""
        n = input_ids.shape[0]
        size = self.padded_size(n)
        assert size is not None
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        if size > n:
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(1)
        return size
