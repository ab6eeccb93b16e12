"""The runner's block tables, kept from step to step (as vLLM v1's InputBatch keeps them).

A request's row is written when it arrives and extended when it gets new blocks (about one
step in block_size for a decode), so a step gathers its requests' rows in one numpy index
instead of converting every request's block list again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np


class BlockTable:
    """Rows of block ids by request id; a freed row is zeroed and reused."""

    def __init__(self, num_rows: int = 64, num_cols: int = 64) -> None:
        self.table = np.zeros((num_rows, num_cols), dtype=np.int32)
        self.num_blocks = np.zeros(num_rows, dtype=np.int64)
        self.rows: dict[str, int] = {}
        self._free_rows = list(range(num_rows - 1, -1, -1))

    @classmethod
    def of(cls, block_ids: Iterable[tuple[str, Sequence[int]]]) -> BlockTable:
        """A table holding these (request id, block ids)."""
        table = cls()
        for request_id, ids in block_ids:
            table.add(request_id, ids)
        return table

    def add(self, request_id: str, block_ids: Sequence[int]) -> None:
        """A new (or resumed) request's row; it replaces the request's old row, if any."""
        self.remove(request_id)
        if not self._free_rows:
            self._grow_rows()
        row = self._free_rows.pop()
        self.rows[request_id] = row
        self.append(request_id, block_ids)

    def append(self, request_id: str, block_ids: Sequence[int]) -> None:
        if not block_ids:
            return
        row = self.rows[request_id]
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.table.shape[1]:
            self._grow_cols(end)
        self.table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def remove(self, request_id: str) -> None:
        row = self.rows.pop(request_id, None)
        if row is None:
            return
        # Zeroed: a row's columns past its blocks read block 0 (always a valid index).
        self.table[row, : self.num_blocks[row]] = 0
        self.num_blocks[row] = 0
        self._free_rows.append(row)

    def gather(self, request_ids: Sequence[str]) -> np.ndarray:
        """[len(request_ids), widest row (at least 1)] int32: the rows in this order."""
        rows = np.fromiter(map(self.rows.__getitem__, request_ids), np.int64, len(request_ids))
        width = max(int(self.num_blocks[rows].max()), 1) if len(rows) else 1
        return self.table[rows, :width]

    def _grow_rows(self) -> None:
        old = self.table.shape[0]
        self.table = np.concatenate([self.table, np.zeros_like(self.table)])
        self.num_blocks = np.concatenate([self.num_blocks, np.zeros_like(self.num_blocks)])
        self._free_rows.extend(range(2 * old - 1, old - 1, -1))

    def _grow_cols(self, min_cols: int) -> None:
        num_rows, num_cols = self.table.shape
        grown = np.zeros((num_rows, max(min_cols, 2 * num_cols)), dtype=np.int32)
        grown[:, :num_cols] = self.table
        self.table = grown
