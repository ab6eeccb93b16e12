"""Verification steps in CUDA graphs: which steps replay one, and where their rows go.

A verification graph holds q = k + 1 query rows for every request (k =
num_speculative_tokens): each request's last token and its k proposals. vLLM captures the
same shape and replays it only for a "uniform decode" step (every request has exactly q
rows). Here a step whose requests have fewer rows (the n-gram proposer found fewer than k
tokens or none, proposals cut at max_tokens or max_model_len) replays it too, padded: each
request's rows are followed by padding rows up to q. That is sound because
- padding rows store no K/V (slot -1), so the cache holds exactly what the eager step stores;
- they come after their request's real rows, and attention is causal: no real row reads them;
- their outputs are dropped before the logits (`PaddedRows.rows` picks the real rows), so the
  rejection sampler never sees a padded position: none is scored, accepted or sampled.
A padding row copies its request's last real token and position (a position past
max_model_len would index past the rotary tables); its request's context grows by the
padding rows, over block-table entries the graph's wider table holds (never read by a real
row).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Below this many rows a forward costs about the same whatever its rows (launch overhead and
# weight reads dominate): padding up to it is free. Past it, a step replays only when padding
# at most doubles its rows; otherwise (a large batch where few requests have proposals) the
# eager step's fewer rows win.
FREE_ROWS = 256


def verify_capture_sizes(max_batch: int) -> list[int]:
    """Batch sizes captured for verification: powers of two up to `max_batch` (and it).

    Fewer than the decode graphs' (every 16 past 8): each holds q times their rows, and the
    start-up goal is a few seconds of capture; a batch pads up to at most twice its size."""
    sizes = [1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch]
    return [*sizes, max_batch]


def replays_verification(counts: Sequence[int], query_len: int, size: int | None) -> bool:
    """Whether a step whose requests have `counts` query rows replays the verification graph
    of `query_len` rows per request, padded to `size` requests (None: past the largest
    captured): every request fits q rows and the padding costs little (see FREE_ROWS)."""
    if not counts or size is None or max(counts) > query_len:
        return False
    return size * query_len <= max(2 * sum(counts), FREE_ROWS)


@dataclass(frozen=True)
class PaddedRows:
    """Where a step's rows go in a graph of `query_len` rows per request (request i owns
    rows i * q to i * q + q - 1), and what the padding rows hold."""

    # [n * q] the step's row each buffer row copies: itself, or for a padding row its
    # request's last real row.
    source: np.ndarray
    # [T] the buffer row of each of the step's rows: the outputs to keep.
    rows: np.ndarray
    # [n] padding rows per request: its context length grows by them.
    extra: np.ndarray


def pad_rows(counts: Sequence[int], query_len: int) -> PaddedRows | None:
    """The padded layout of a step whose request i has counts[i] rows (1 to query_len);
    None when every request has exactly query_len rows (they copy in as they are)."""
    counts_np = np.asarray(counts, dtype=np.int64)
    if counts_np.size and (counts_np.min() < 1 or counts_np.max() > query_len):
        raise ValueError(f"query rows per request must be 1 to {query_len}, got {counts}")
    if (counts_np == query_len).all():
        return None
    num_reqs = len(counts_np)
    starts = np.zeros(num_reqs, dtype=np.int64)
    np.cumsum(counts_np[:-1], out=starts[1:])
    slot = np.arange(num_reqs * query_len, dtype=np.int64)
    request, offset = slot // query_len, slot % query_len
    source = starts[request] + np.minimum(offset, counts_np[request] - 1)
    total = int(counts_np.sum())
    owner = np.repeat(np.arange(num_reqs, dtype=np.int64), counts_np)
    rows = owner * query_len + (np.arange(total, dtype=np.int64) - starts[owner])
    return PaddedRows(source, rows, query_len - counts_np)
