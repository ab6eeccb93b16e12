"""CUDA graphs for decode and verification steps, one per padded batch size, all captured at
start-up.

A decode step launches hundreds of small kernels; replaying one graph removes the launch
overhead that otherwise bounds small batches. Inputs live in persistent buffers the graph
reads; a batch is padded up to the nearest captured size (padding rows store no K/V).
Capturing every size before serving keeps kernel compiles and captures out of the requests'
time (a size first met while serving stalled every running request for its compile), and
out of the way of threads that use the device beside the steps (KV transfers).
The same machinery serves the target model's decode steps and a proposer's one-token
steps (draft model or EAGLE head): each passes the forward to capture. With q query rows per
request (`query_len`) it serves the target's speculative verification steps: each request's
last token and its k = q - 1 proposals (see verify_layout.py for the padding).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from asyncserve.kernels.parallel_compiles import compile_for
from asyncserve.models.attention import AttentionMetadata
from asyncserve.models.base import CausalLM
from asyncserve.worker.input_batch import HostStaging, StepInputs
from asyncserve.worker.verify_layout import pad_rows

logger = logging.getLogger(__name__)

# (input_ids [T], positions [T], attention metadata) -> the step's outputs, each with a row
# per token first (the logits or hidden states first).
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


def hidden_forward(
    model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
) -> DecodeForward:
    """A model's forward whose one output is its last hidden states."""

    def forward(
        input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, ...]:
        return (model(input_ids, positions, kv_caches, meta),)

    return forward


def capture_sizes(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch + 16, 16))
    return sorted({min(s, max_batch) for s in sizes})


def padded_batch_size(sizes: list[int], num_reqs: int) -> int | None:
    """The smallest captured size that holds `num_reqs` rows; None past the largest."""
    return next((size for size in sizes if size >= num_reqs), None)


class DecodeGraphs:
    """Graphs of `query_len` rows per request (1: decode), one per batch size in `sizes`
    (default capture_sizes); `pool`: a memory pool shared with other graphs of which only
    one replays at a time, its outputs read before the next replays."""

    def __init__(
        self,
        forward: DecodeForward,
        max_batch: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        query_len: int = 1,
        sizes: list[int] | None = None,
        pool: Any = None,
    ) -> None:
        self.forward = forward
        self.sizes = sizes if sizes is not None else capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.query_len = q = query_len
        # Padding rows extend a request's context by up to q - 1 positions past the last
        # real one (verify_layout.py): the kernels' bound and the block tables cover them.
        self.max_seqlen_k = max_model_len + q - 1
        self.device = device
        max_blocks = -(-self.max_seqlen_k // block_size)
        n = self.max_batch
        self.input_ids = torch.zeros(n * q, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n * q, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n * q,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.full((n,), q, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((n, max_blocks), dtype=torch.int32, device=device)
        # Every request has q query rows: cumulative lengths are 0, q, 2q, ...
        self.cu_seqlens_q = torch.arange(0, n * q + 1, q, dtype=torch.int32, device=device)
        # Attention's program order (AttentionMetadata.seq_order): the step's, or as listed.
        self.identity_order = torch.arange(n, dtype=torch.int32, device=device)
        self.seq_order = self.identity_order.clone()
        self.permuted_rows = 0  # seq_order differs from identity_order only before this row
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        self.pool = pool
        self.staging = HostStaging(device)

    def padded_size(self, num_reqs: int) -> int | None:
        return padded_batch_size(self.sizes, num_reqs)

    def fits(self, num_reqs: int, table_width: int) -> bool:
        """Whether a step of `num_reqs` requests with block tables `table_width` wide can replay."""
        return self.padded_size(num_reqs) is not None and table_width <= self.block_tables.shape[1]

    def inputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The buffers a graph of `size` requests reads: the forward's arguments."""
        rows = size * self.query_len
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:rows],
            cu_seqlens_q=self.cu_seqlens_q[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            max_seqlen_q=self.query_len,
            # An upper bound fixes the kernel's grid; the kernel reads each true length.
            max_seqlen_k=self.max_seqlen_k,
            seq_order=self.seq_order[:size],
        )
        return self.input_ids[:rows], self.positions[:rows], meta

    def _padding_inputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        # Padding values while capturing: nothing is written to the KV cache.
        self.slot_mapping[: size * self.query_len].fill_(-1)
        self.seq_lens[:size].fill_(self.query_len)
        self._set_order(None)  # a step's order may name requests past `size`
        return self.inputs(size)

    def _set_order(self, order: torch.Tensor | None) -> None:
        """seq_order = `order` on its rows and the listed order after them (the padding
        requests, the shortest, last); copies only the rows that change."""
        rows = 0 if order is None else order.shape[0]
        if order is not None:
            self.seq_order[:rows].copy_(order)
        if self.permuted_rows > rows:
            listed = slice(rows, self.permuted_rows)
            self.seq_order[listed].copy_(self.identity_order[listed])
        self.permuted_rows = rows

    def run_each_size(self, sizes: list[int] | None = None) -> None:
        """One eager forward of each size (default all) not yet captured, on padding inputs:
        under compile_for (parallel_compiles.py), it compiles their kernels on threads."""
        with torch.inference_mode():
            for size in self.sizes if sizes is None else sizes:
                if size not in self.graphs:
                    self.forward(*self._padding_inputs(size))

    def _capture(self, size: int) -> None:
        start = time.perf_counter()
        self.forward(*self._padding_inputs(size))  # compiles the kernels outside the capture
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        # thread_local: another thread's device calls (a KV transfer) leave the capture valid.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            outputs = self.forward(*self.inputs(size))
        self.graphs[size] = (graph, outputs)
        logger.debug(
            "captured a graph for batch %d (%d rows each) in %.3f s",
            size, self.query_len, time.perf_counter() - start,
        )  # fmt: skip

    def capture(self, size: int) -> None:
        """One size's graph, without capture_all's log line."""
        if size not in self.graphs:
            self._capture(size)

    def capture_all(self, what: str = "decode", compile_first: bool = True) -> None:
        """Every size, largest first (the smaller graphs reuse the largest one's pool);
        `compile_first`: their kernels compiled on threads before (the target's decode
        graphs' were, with the profile step's: worker/kv_pool.py)."""
        start = time.perf_counter()
        if compile_first:
            compile_for(self.device, f"{what} graphs", self.run_each_size)
        for size in reversed(self.sizes):
            if size not in self.graphs:
                self._capture(size)
        logger.info(
            "captured %d %s graphs (batch 1 to %d, %d query rows a request) in %.1f s",
            len(self.sizes), what, self.max_batch, self.query_len, time.perf_counter() - start,
        )  # fmt: skip

    def run(
        self,
        inputs: StepInputs,
        positions: torch.Tensor | None = None,
        counts: list[int] | None = None,
    ) -> torch.Tensor:
        """The first output (decode: logits [num_reqs, this rank's vocabulary slice]) of a
        step by graph replay; `positions` replaces the step's (M-RoPE models: index +
        delta); `counts`: query rows per request when some have fewer than query_len."""
        positions = inputs.positions if positions is None else positions
        return self.replay(inputs.input_ids, positions, inputs.meta, counts)[0]

    def replay(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        counts: list[int] | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """The forward's outputs for the step's rows, by graph replay. Without padding
        inside requests they are views of the graph's own buffers: read them before the
        next replay of a graph in this pool."""
        size = self.padded_size(meta.seq_lens.shape[0])
        assert size is not None
        # Capturing runs on padding values, so the step's inputs go in after it.
        if size not in self.graphs:
            self._capture(size)
        rows = self._fill(input_ids, positions, meta, counts)[1]
        graph, outputs = self.graphs[size]
        graph.replay()
        return tuple(output[rows] for output in outputs)

    def forward_eagerly(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        counts: list[int] | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """What `replay` computes, without a graph: the step copied into the buffers and
        padded, the forward run on them (the CPU tests check the buffers this way)."""
        size, rows = self._fill(input_ids, positions, meta, counts)
        return tuple(output[rows] for output in self.forward(*self.inputs(size)))

    def fill(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        counts: list[int] | None = None,
    ) -> int:
        """Copy a step into the input buffers, padded to its captured size (returned)."""
        return self._fill(input_ids, positions, meta, counts)[0]

    def _fill(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        counts: list[int] | None,
    ) -> tuple[int, slice | torch.Tensor]:
        """Copy a step into the input buffers: request i's rows from row i * query_len on,
        padded with rows that write no K/V (verify_layout.py) up to query_len when
        `counts` (rows per request) says it has fewer; padding requests up to the captured
        size write no K/V and attend to query_len positions. Returns the size and which
        buffer rows hold the step's rows."""
        n = meta.seq_lens.shape[0]
        size = self.padded_size(n)
        assert size is not None
        q = self.query_len
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.block_tables)
        layout = None if counts is None or q == 1 else pad_rows(counts, q)
        rows: slice | torch.Tensor
        if layout is None:
            rows = slice(0, n * q)
            self.input_ids[rows].copy_(input_ids)
            self.positions[rows].copy_(positions)
            self.slot_mapping[rows].copy_(meta.slot_mapping)
            self.seq_lens[:n].copy_(meta.seq_lens)
        else:
            source, rows, extra = self.staging.to_device([layout.source, layout.rows, layout.extra])
            padded = slice(0, n * q)
            self.input_ids[padded].copy_(input_ids[source])
            self.positions[padded].copy_(positions[source])
            self.slot_mapping[padded].fill_(-1)
            self.slot_mapping.index_copy_(0, rows, meta.slot_mapping)
            self.seq_lens[:n].copy_(meta.seq_lens + extra)
        if size > n:
            self.slot_mapping[n * q : size * q].fill_(-1)
            self.seq_lens[n:size].fill_(q)
        self._set_order(meta.seq_order if layout is None else None)
        return size, rows
