"""The rejection sampler: greedy rows decode exactly, random rows keep the target distribution."""

from __future__ import annotations

import pytest
import torch

from asyncserve.sampling_params import SamplingParams
from asyncserve.spec_decode.rejection_sampler import SpecLayout, rejection_sample, target_probs
from asyncserve.worker.sampling_metadata import SamplingMetadata, SamplingRow

CPU = torch.device("cpu")
# The statistical test also runs on the GPU where there is one.
DEVICES = [CPU] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
VOCAB = 6
# Chi-square critical values at p = 0.001; the draws are seeded, so a pass is reproducible.
CHI2_CRITICAL_001 = {5: 20.52, 3: 16.27, 4: 18.47}


def _meta(params: SamplingParams, num_rows: int, device: torch.device = CPU) -> SamplingMetadata:
    row = SamplingRow(params=params, prompt_token_ids=[0], output_token_ids=[], generator=None)
    return SamplingMetadata.build([row] * num_rows, VOCAB, device)


def test_greedy_accepts_up_to_the_first_mismatch() -> None:
    # Two requests: 3 drafts (the middle one wrong) and 1 draft (right).
    logits = torch.full((6, VOCAB), -1.0)
    for row, best in enumerate([2, 4, 1, 5, 3, 0]):
        logits[row, best] = 1.0
    layout = SpecLayout.build([[2, 0, 1], [3]], CPU)
    out = rejection_sample(logits, _meta(SamplingParams(temperature=0.0), 6), layout)
    assert out.tolist() == [[2, 4, -1, -1], [3, 0, -1, -1]]


def test_no_drafts_is_plain_sampling() -> None:
    logits = torch.tensor([[0.0, 3.0, 0.0, 0.0, 0.0, 0.0]])
    out = rejection_sample(
        logits, _meta(SamplingParams(temperature=0.0), 1), SpecLayout.build([[]], CPU)
    )
    assert out.tolist() == [[1]]


def _chi2(samples: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the categories with positive probability, and its df."""
    samples, probs = samples.cpu(), probs.cpu()
    counts = torch.bincount(samples, minlength=len(probs)).double()
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a token the target rules out"
    expected = probs[support].double() * len(samples)
    stat = ((counts[support] - expected) ** 2 / expected).sum().item()
    return stat, int(support.sum()) - 1


@pytest.mark.parametrize("device", DEVICES, ids=str)
@pytest.mark.parametrize(
    ("params", "one_hot"),
    [
        (SamplingParams(temperature=1.0), True),
        (SamplingParams(temperature=0.7, top_k=5), True),
        (SamplingParams(temperature=1.3, top_p=0.85), False),
        (SamplingParams(temperature=0.9, top_k=4, top_p=0.9), False),
    ],
)
def test_tokens_follow_the_target_distribution(
    params: SamplingParams, one_hot: bool, device: torch.device
) -> None:
    """Many requests with two proposals each from one position's logits: the first token
    is distributed as p_1 and, when the first proposal was accepted, the second as p_2,
    whatever the proposer's distribution (one-hot as n-gram, or a draft model's q)."""
    torch.manual_seed(0)
    n = 40_000
    p_logits = torch.tensor(
        [[1.0, 0.2, -0.5, 0.8, 0.0, -1.0], [0.3, 1.2, 0.1, -0.4, 0.9, 0.0]], device=device
    )
    q_logits = torch.tensor(
        [[0.0, 1.0, 0.5, -0.2, 0.3, 0.1], [1.0, 0.0, 0.2, 0.5, 0.6, -0.3]], device=device
    )
    meta = _meta(params, 3 * n, device)
    # The proposer's distribution, processed as the target's (top-k / top-p on both).
    q = target_probs(q_logits.repeat(2, 1)[:3], _meta(params, 3, device))
    drafts_1 = torch.multinomial(q[0], n, replacement=True)
    drafts_2 = torch.multinomial(q[1], n, replacement=True)
    layout = SpecLayout.build(
        [[a, b] for a, b in zip(drafts_1.tolist(), drafts_2.tolist(), strict=True)], device
    )
    logits = torch.cat([p_logits, p_logits[:1]]).repeat(n, 1)
    draft_probs = None if one_hot else q.repeat(n, 1)
    if one_hot:  # n-gram: the proposals are fixed tokens, not draws
        fixed = torch.tensor([0, 3])
        layout = SpecLayout.build([fixed.tolist()] * n, device)
    out = rejection_sample(logits, meta, layout, draft_probs)
    p = target_probs(logits[:3], _meta(params, 3, device))

    stat, df = _chi2(out[:, 0], p[0])
    assert stat < CHI2_CRITICAL_001[df], (stat, df)
    first_draft = layout.draft_ids.view(n, 3)[:, 0]
    accepted = out[:, 0] == first_draft
    assert accepted.sum() > 1000
    stat, df = _chi2(out[accepted, 1], p[1])
    assert stat < CHI2_CRITICAL_001[df], (stat, df)
