"""N-gram (prompt lookup) proposer: the tokens that followed the last match of the suffix.

For n from prompt_lookup_max down to prompt_lookup_min, the request's last n tokens are
looked up earlier in its own tokens (prompt and output); the latest match wins and the
tokens after it are the proposal. Plain host work on the token ids, no model.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, lookup_min: int, lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max

    def propose(self, token_ids: np.ndarray) -> list[int]:
        """Up to k tokens to follow `token_ids` (1-D int64); empty when no suffix matches."""
        total = len(token_ids)
        for n in range(min(self.lookup_max, total - 1), self.lookup_min - 1, -1):
            suffix = token_ids[total - n :]
            # Windows that start before the suffix itself: candidates [0, total - n).
            windows = sliding_window_view(token_ids[: total - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if len(hits) == 0:
                continue
            start = int(hits[-1]) + n
            proposal = token_ids[start : start + self.k]
            if len(proposal):
                return [int(t) for t in proposal]
        return []
