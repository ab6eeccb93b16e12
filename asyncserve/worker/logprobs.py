"""Logprobs in one columnar shape for sampled and prompt tokens: top-k and the rank of a
chosen token, batched on the device (gather_logprobs), then one host entry per row
(row_entry)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from asyncserve.core.step import StepResult
from asyncserve.worker.input_batch import CachedRequestState, StepInputs


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


def prompt_logprobs(
    model: Any,
    states: Mapping[str, CachedRequestState],
    inputs: StepInputs,
    hidden: torch.Tensor,
    result: StepResult,
) -> None:
    """Logprobs of each prompt token given the tokens before it, chunk by chunk, into
    result.prompt_logprobs for the requests that ask for them."""
    offset = 0
    for rid, start, count in zip(inputs.request_ids, inputs.starts, inputs.counts, strict=True):
        state = states[rid]
        k = state.sampling_params.prompt_logprobs
        num_prompt = len(state.prompt_token_ids)
        # Position j predicts prompt token j + 1.
        last = min(start + count, num_prompt - 1)
        if k is None or start >= last:
            offset += count
            continue
        logits = model.driver_logits(hidden[offset : offset + (last - start)])
        if logits is None:  # a tensor-parallel rank other than the driver: no result here
            offset += count
            continue
        logprobs = torch.log_softmax(logits, dim=-1)
        targets = torch.tensor(state.prompt_token_ids[start + 1 : last + 1], device=logprobs.device)
        ids, vals, ranks = gather_logprobs(logprobs, targets, k)
        entries = [
            row_entry(i, v, r, k)
            for i, v, r in zip(ids.tolist(), vals.tolist(), ranks.tolist(), strict=True)
        ]
        result.prompt_logprobs[rid] = (start + 1, entries)
        offset += count
