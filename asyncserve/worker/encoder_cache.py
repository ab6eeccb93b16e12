"""EncoderCache: image embeddings by content hash, so a repeated image is encoded once.

Bounded in embedding rows (LRU). A step takes what it needs before it inserts what it
encoded, so an entry evicted between two chunks of one prompt is simply encoded again.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    def __init__(self, capacity_rows: int) -> None:
        if capacity_rows < 1:
            raise ValueError(f"encoder cache capacity must be >= 1 row, got {capacity_rows}")
        self.capacity_rows = capacity_rows
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._rows = 0
        # Counters for metrics and tests: lookups served, and items encoded.
        self.hits = 0
        self.num_encoded = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> torch.Tensor | None:
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
            self.hits += 1
        return value

    def put(self, key: str, value: torch.Tensor) -> None:
        """Insert (most recently used), evicting the least recently used entries; an entry
        larger than the whole cache is not kept."""
        rows = value.shape[0]
        old = self._entries.pop(key, None)
        if old is not None:
            self._rows -= old.shape[0]
        if rows > self.capacity_rows:
            return
        while self._rows + rows > self.capacity_rows:
            _, gone = self._entries.popitem(last=False)
            self._rows -= gone.shape[0]
        self._entries[key] = value
        self._rows += rows

    def clear(self) -> None:
        self._entries.clear()
        self._rows = 0
