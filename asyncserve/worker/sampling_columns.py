"""Per-row sampling knobs as numpy columns, kept from step to step (as vLLM v1's InputBatch
keeps its temperature, top-p, top-k arrays).

A request's row is written once, when it arrives; a step gathers its sampled requests' rows
with one numpy index, so building the sampling metadata reads no SamplingParams per row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from asyncserve.sampling_params import SamplingParams

# logprobs column of a row that asked for none (asked values are >= 0).
NO_LOGPROBS = -1


@dataclass
class BatchColumns:
    """One step's sampling knobs, one entry per sampled row."""

    greedy: np.ndarray  # bool
    temperature: np.ndarray  # float64, as asked (greedy rows included)
    top_k: np.ndarray  # int64, 0 = no top-k
    top_p: np.ndarray  # float64
    min_p: np.ndarray  # float64
    # Uses a feature most batches do not: penalties, min_tokens, bad words, logit_bias,
    # allowed_token_ids.
    extras: np.ndarray  # bool
    # Samples with its own seeded generator (seeded and not greedy).
    seeded: np.ndarray  # bool
    logprobs: np.ndarray  # int64, NO_LOGPROBS when not asked

    @classmethod
    def of(cls, params: Sequence[SamplingParams], seeded: Sequence[bool]) -> BatchColumns:
        """Columns computed from the rows' parameters (`seeded`: whether each row has
        a generator; a greedy row's is not used)."""
        table = SamplingColumns(num_rows=max(len(params), 1))
        ids = [str(i) for i in range(len(params))]
        for request_id, p in zip(ids, params, strict=True):
            table.add(request_id, p)
        columns = table.gather(ids)
        has_generator = np.fromiter(seeded, dtype=np.bool_, count=len(params))
        columns.seeded = has_generator & ~columns.greedy
        return columns


class SamplingColumns:
    """Sampling knobs by request id; a freed row is reused."""

    def __init__(self, num_rows: int = 64) -> None:
        self.greedy = np.zeros(num_rows, dtype=np.bool_)
        self.temperature = np.ones(num_rows, dtype=np.float64)
        self.top_k = np.zeros(num_rows, dtype=np.int64)
        self.top_p = np.ones(num_rows, dtype=np.float64)
        self.min_p = np.zeros(num_rows, dtype=np.float64)
        self.extras = np.zeros(num_rows, dtype=np.bool_)
        self.seeded = np.zeros(num_rows, dtype=np.bool_)
        self.logprobs = np.full(num_rows, NO_LOGPROBS, dtype=np.int64)
        self.rows: dict[str, int] = {}
        self._free_rows = list(range(num_rows - 1, -1, -1))

    def add(self, request_id: str, params: SamplingParams) -> None:
        """A new (or resumed) request's row; it replaces the request's old row, if any."""
        self.remove(request_id)
        if not self._free_rows:
            self._grow()
        row = self._free_rows.pop()
        self.rows[request_id] = row
        greedy = params.greedy
        self.greedy[row] = greedy
        self.temperature[row] = params.temperature
        self.top_k[row] = params.top_k
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.extras[row] = bool(
            params.needs_penalties
            or params.min_tokens
            or params.bad_words_token_ids
            or params.logit_bias
            or params.allowed_token_ids is not None
        )
        self.seeded[row] = params.seed is not None and not greedy
        self.logprobs[row] = NO_LOGPROBS if params.logprobs is None else params.logprobs

    def remove(self, request_id: str) -> None:
        row = self.rows.pop(request_id, None)
        if row is not None:
            self._free_rows.append(row)

    def gather(self, request_ids: Sequence[str]) -> BatchColumns:
        """The rows of these requests, in this order."""
        rows = np.fromiter(map(self.rows.__getitem__, request_ids), np.int64, len(request_ids))
        return BatchColumns(
            greedy=self.greedy[rows],
            temperature=self.temperature[rows],
            top_k=self.top_k[rows],
            top_p=self.top_p[rows],
            min_p=self.min_p[rows],
            extras=self.extras[rows],
            seeded=self.seeded[rows],
            logprobs=self.logprobs[rows],
        )

    def _grow(self) -> None:
        old = len(self.greedy)
        for name in ("greedy", "temperature", "top_k", "top_p", "min_p", "extras", "seeded"):
            column = getattr(self, name)
            setattr(self, name, np.concatenate([column, np.zeros_like(column)]))
        self.logprobs = np.concatenate([self.logprobs, np.full(old, NO_LOGPROBS, np.int64)])
        self._free_rows.extend(range(2 * old - 1, old - 1, -1))
