"""Top-k logprobs and the rank of a chosen token, batched on the device."""

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
