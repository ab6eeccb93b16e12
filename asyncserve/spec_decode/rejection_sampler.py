"""Rejection sampling of proposed tokens against the target model, on the device.

Request b proposes k_b tokens d_1..d_k and the target scores k_b + 1 positions in one
forward pass; position j's distribution p_j is the target's after the request's sampling
processing (temperature, min_p, top-k, top-p: the same as without speculation). Draft j is
accepted with probability min(1, p_j(d_j) / q_j(d_j)), where q_j is the proposer's
distribution (one-hot for the n-gram proposer); at the first rejection a token is drawn
from max(p_j - q_j, 0) (renormalised), and when every draft is accepted a bonus token is
drawn from p_{k+1}. The tokens produced follow the target distribution exactly
(Leviathan et al., 2023). Greedy rows accept a draft when it is the target's argmax and
then take the argmax, so their output equals decoding without speculation.

Everything stays on the device; the only Python loop is over seeded rows' generators.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncserve.worker.sampler import apply_min_p_, apply_top_k_top_p_, process_logits
from asyncserve.worker.sampling_metadata import SamplingMetadata

_TINY = torch.finfo(torch.float32).tiny


@dataclass
class SpecLayout:
    """Where each request's rows sit in the flattened [T, V] logits.

    `index` [B, K + 1] holds request b's row for position j (j <= k_b; padded with its last
    row), `num_drafts` [B] is k_b, and `draft_ids` [T] is the draft scored at each row (-1 on
    a request's last row, which has none).
    """

    index: torch.Tensor
    num_drafts: torch.Tensor
    draft_ids: torch.Tensor
    # The rows that score a draft, on the host: only those draw a seeded uniform.
    draft_rows: frozenset[int] = frozenset()

    @classmethod
    def build(cls, drafts: list[list[int]], device: torch.device) -> SpecLayout:
        width = max((len(d) for d in drafts), default=0) + 1
        index: list[list[int]] = []
        draft_ids: list[int] = []
        draft_rows: set[int] = set()
        for d in drafts:
            first = len(draft_ids)
            rows = [first + min(j, len(d)) for j in range(width)]
            index.append(rows)
            draft_rows.update(range(first, first + len(d)))
            draft_ids.extend(d)
            draft_ids.append(-1)
        pin = device.type == "cuda"

        def to_device(data: object) -> torch.Tensor:
            t = torch.tensor(data, dtype=torch.int64, pin_memory=pin)
            return t.to(device, non_blocking=pin)

        return cls(
            index=to_device(index),
            num_drafts=to_device([len(d) for d in drafts]),
            draft_ids=to_device(draft_ids),
            draft_rows=frozenset(draft_rows),
        )


def target_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The distribution each random row samples from, after the sampler's processing;
    rows are as in `meta` (greedy rows hold a harmless softmax)."""
    assert meta.temperature is not None
    logits = logits / meta.temperature.unsqueeze(1)
    if meta.min_p is not None:
        apply_min_p_(logits, meta.min_p)
    apply_top_k_top_p_(logits, meta.top_k, meta.max_top_k, meta.top_p)
    return logits.softmax(dim=-1)


def rejection_sample(
    logits: torch.Tensor,
    meta: SamplingMetadata,
    layout: SpecLayout,
    draft_probs: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [T, V] (one row per scored position, `meta` rows alike) -> [B, K + 1] int64:
    each request's accepted drafts, then the token drawn at the first rejection (or the
    bonus token), then -1. `draft_probs` [T, V]: the proposer's distribution per row (rows
    without a draft are ignored); None means one-hot on the draft (n-gram)."""
    logits = process_logits(logits.float(), meta)
    num_rows = logits.shape[0]
    has_draft = layout.draft_ids >= 0
    drafts = layout.draft_ids.clamp(min=0)
    rows = torch.arange(num_rows, device=logits.device)

    greedy_tokens = None if meta.all_random else logits.argmax(dim=-1)
    if meta.all_greedy:
        assert greedy_tokens is not None
        accepted = has_draft & (greedy_tokens == drafts)
        recovered = greedy_tokens
    else:
        p = target_probs(logits, meta)
        p_draft = p[rows, drafts]
        if draft_probs is None:
            q_draft = torch.ones_like(p_draft)
            residual = p.clone()
            residual[rows, drafts] = 0.0
        else:
            q = draft_probs.float()
            q_draft = q[rows, drafts]
            residual = (p - q).clamp_(min=0.0)
        # Rows without a draft (the bonus position) sample p itself.
        residual = torch.where(has_draft.unsqueeze(1), residual, p)
        # p - q can vanish only where the draft is always accepted; keep p as a fallback.
        empty = residual.sum(dim=-1, keepdim=True) <= 0
        residual = torch.where(empty, p, residual)
        uniform = _uniform(num_rows, meta, layout.draft_rows, logits.device)
        accepted = has_draft & (uniform * q_draft < p_draft)
        recovered = sample_from(residual, meta)
        if greedy_tokens is not None:
            assert meta.greedy_mask is not None
            greedy_accepted = has_draft & (greedy_tokens == drafts)
            accepted = torch.where(meta.greedy_mask, greedy_accepted, accepted)
            recovered = torch.where(meta.greedy_mask, greedy_tokens, recovered)

    index = layout.index
    width = index.shape[1]
    # Accepted drafts count up to the first rejection (a row past k_b has no draft).
    num_accepted = accepted[index].long().cumprod(dim=1).sum(dim=1, keepdim=True)
    col = torch.arange(width, device=logits.device).unsqueeze(0)
    out = torch.where(col < num_accepted, drafts[index], recovered[index])
    return out.masked_fill_(col > num_accepted, -1)


def _uniform(
    num_rows: int, meta: SamplingMetadata, draft_rows: frozenset[int], device: torch.device
) -> torch.Tensor:
    u = torch.rand(num_rows, device=device)
    for row, generator in meta.generators.items():
        # A seeded row without a draft draws only its token, as it would in a step without
        # proposals: its stream does not depend on whether other requests propose.
        if row in draft_rows:
            u[row] = torch.rand(1, device=device, generator=generator)[0]
    return u


def sample_from(weights: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """One draw per row proportional to `weights` (need not sum to 1): argmax(w / q),
    q ~ Exponential(1)."""
    q = torch.empty_like(weights)
    q.exponential_()
    for row, generator in meta.generators.items():
        q[row].exponential_(generator=generator)
    q.clamp_(min=_TINY)
    return (weights / q).argmax(dim=-1)
