"""Logprobs in one columnar shape for sampled and prompt tokens: top-k and the rank of a
chosen token, batched on the device (gather_logprobs), then one host entry per row
(row_entry)."""

from __future__ import annotations

import torch


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs of `token_ids` and of each row's top `num_logprobs` tokens.

    logprobs [N, V] (log_softmax), token_ids [N] int64. Returns
      ids   [N, 1 + num_logprobs] int64: column 0 is token_ids, then the top-k, best first
      vals  [N, 1 + num_logprobs] float32: their logprobs
      ranks [N] int64: 1 + how many tokens have a strictly larger logprob than token_ids
    """
    chosen = token_ids.view(-1, 1)
    chosen_lp = logprobs.gather(1, chosen)
    ranks = (logprobs > chosen_lp).sum(dim=-1) + 1
    top_lp, top_ids = logprobs.topk(num_logprobs, dim=-1)
    ids = torch.cat((chosen, top_ids), dim=1)
    vals = torch.cat((chosen_lp, top_lp), dim=1).float()
    return ids, vals, ranks


# One row on the host: (token id -> logprob) of the top-k plus the chosen token, and the
# chosen token's 1-based rank.
LogprobEntry = tuple[dict[int, float], int]


def row_entry(ids: list[int], vals: list[float], rank: int, num_logprobs: int) -> LogprobEntry:
    """One row of gather_logprobs' output (as lists), keeping `num_logprobs` of its top-k."""
    entry = dict(zip(ids[1 : 1 + num_logprobs], vals[1 : 1 + num_logprobs], strict=True))
    entry[int(ids[0])] = float(vals[0])
    return entry, int(rank)
