"""Verification of a step's proposals: the sampler's counterpart for speculative steps."""

from __future__ import annotations

import torch

from asyncserve.spec_decode.rejection_sampler import SpecLayout, rejection_sample
from asyncserve.worker.logprobs import gather_logprobs
from asyncserve.worker.sampler import SamplerOutput
from asyncserve.worker.sampling_metadata import SamplingMetadata, SamplingRow


def expand_request_ids(request_ids: list[str], spec: list[list[int]]) -> list[str]:
    """Each request's id once per scored row (k + 1 rows for k proposals)."""
    return [rid for rid, s in zip(request_ids, spec, strict=True) for _ in range(len(s) + 1)]


def verify(
    logits: torch.Tensor,
    rows: list[SamplingRow],
    spec: list[list[int]],
    vocab_size: int,
    device: torch.device,
    draft_probs: list[torch.Tensor | None] | None = None,
) -> SamplerOutput:
    """logits [sum(k_b + 1), V] -> sampled ids [B, K + 1] (-1 padded): accepted proposals,
    then one token from the target. A request without proposals samples as usual (its one
    row); only those may ask for logprobs (see spec_decode.config.can_speculate), which are
    reported for each request's first token. `draft_probs`: per request, the [k, V]
    distributions its proposals were drawn from (None: a fixed proposal)."""
    expanded = [row for row, s in zip(rows, spec, strict=True) for _ in range(len(s) + 1)]
    meta = SamplingMetadata.build(expanded, vocab_size, device)
    layout = SpecLayout.build(spec, device)
    q = None
    if draft_probs is not None and any(p is not None for p in draft_probs):
        # One row per scored position; a request's last row (no proposal) stays zero.
        q = logits.new_zeros(logits.shape, dtype=torch.float32)
        row = 0
        for probs, s in zip(draft_probs, spec, strict=True):
            if probs is not None and s:
                q[row : row + len(s)] = probs[: len(s)]
            row += len(s) + 1
    sampled = rejection_sample(logits, meta, layout, q)
    if meta.max_num_logprobs is None:
        return SamplerOutput(sampled_token_ids=sampled)
    last_rows = layout.index[:, -1]
    raw = logits[last_rows].float().log_softmax(dim=-1)
    ids, vals, ranks = gather_logprobs(raw, sampled[:, 0], meta.max_num_logprobs)
    return SamplerOutput(
        sampled_token_ids=sampled, logprob_token_ids=ids, logprobs=vals, sampled_ranks=ranks
    )
