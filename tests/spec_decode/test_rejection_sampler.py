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
SAMPLING_CASES = [
    (SamplingParams(temperature=1.0), True),
    (SamplingParams(temperature=0.7, top_k=5), True),
    (SamplingParams(temperature=1.3, top_p=0.85), False),
    (SamplingParams(temperature=0.9, top_k=4, top_p=0.9), False),
]
# The distribution test makes two chi-square checks per case and device; their family
# fails by chance with probability at most 0.001 (Bonferroni), whatever the device's
# random stream.
FAMILY_ALPHA = 0.001
NUM_CHECKS = 2 * len(SAMPLING_CASES) * len(DEVICES)
# Requests per case: at least 40,000 reach the second position, enough that a bias of two
# percentage points between the two likeliest tokens fails (checked below).
NUM_REQUESTS = 150_000
BIAS = 0.02


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


def chi2_critical(df: int, alpha: float) -> float:
    """The chi-square quantile with upper tail `alpha`: bisection on the survival
    function, the regularised upper incomplete gamma Q(df / 2, x / 2)."""
    shape = torch.tensor(df / 2, dtype=torch.float64)
    low, high = 0.0, 1000.0
    for _ in range(100):
        mid = (low + high) / 2
        tail = torch.special.gammaincc(shape, torch.tensor(mid / 2, dtype=torch.float64))
        low, high = (mid, high) if tail.item() > alpha else (low, mid)
    return high


def test_chi2_critical_matches_the_tables() -> None:
    assert chi2_critical(3, 0.001) == pytest.approx(16.266, abs=1e-3)
    assert chi2_critical(5, 0.001) == pytest.approx(20.515, abs=1e-3)
    assert chi2_critical(1, 0.05) == pytest.approx(3.841, abs=1e-3)


def _biased(probs: torch.Tensor, amount: float) -> torch.Tensor:
    """`probs` with `amount` of probability moved from its likeliest token to the next."""
    top = probs.topk(2).indices
    out = probs.clone()
    out[top[0]] -= amount
    out[top[1]] += amount
    return out


def chi2_statistic(samples: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the categories with positive probability, and its df."""
    samples, probs = samples.cpu(), probs.cpu()
    counts = torch.bincount(samples, minlength=len(probs)).double()
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a token the target rules out"
    expected = probs[support].double() * len(samples)
    stat = ((counts[support] - expected) ** 2 / expected).sum().item()
    return stat, int(support.sum()) - 1


# Target and proposer logits at the two proposed positions.
P_LOGITS = [[1.0, 0.2, -0.5, 0.8, 0.0, -1.0], [0.3, 1.2, 0.1, -0.4, 0.9, 0.0]]
Q_LOGITS = [[0.0, 1.0, 0.5, -0.2, 0.3, 0.1], [1.0, 0.0, 0.2, 0.5, 0.6, -0.3]]


def sample_two_positions(
    params: SamplingParams, one_hot: bool, n: int, device: torch.device, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """n requests with two proposals each (fixed tokens as n-gram's, or draws from the
    proposer's q), rejection-sampled against P_LOGITS: (output [n, 3], proposals [n, 2],
    the target's processed distributions [2, V]), on the CPU."""
    torch.manual_seed(seed)
    p_logits = torch.tensor(P_LOGITS, device=device)
    meta = _meta(params, 3 * n, device)
    # The proposer's distribution, processed as the target's (top-k / top-p on both).
    q_logits = torch.tensor([*Q_LOGITS, Q_LOGITS[0]], device=device)
    q = target_probs(q_logits, _meta(params, 3, device))
    if one_hot:  # n-gram: the proposals are fixed tokens, not draws
        drafts = torch.tensor([[0, 3]]).expand(n, 2)
    else:
        # Drawn on the CPU from a generator of their own, so that the proposals are
        # independent draws from q on any device (only the sampler's draws are tested).
        cpu = torch.Generator().manual_seed(seed + 1)
        drafts = torch.stack(
            [torch.multinomial(q[j].cpu(), n, replacement=True, generator=cpu) for j in (0, 1)],
            dim=1,
        )
    layout = SpecLayout.build(drafts.tolist(), device)
    logits = torch.cat([p_logits, p_logits[:1]]).repeat(n, 1)
    draft_probs = None if one_hot else q.repeat(n, 1)
    out = rejection_sample(logits, meta, layout, draft_probs).cpu()
    p = target_probs(logits[:2], _meta(params, 2, device)).cpu()
    return out, drafts, p


@pytest.mark.parametrize("device", DEVICES, ids=str)
@pytest.mark.parametrize(("params", "one_hot"), SAMPLING_CASES)
def test_tokens_follow_the_target_distribution(
    params: SamplingParams, one_hot: bool, device: torch.device
) -> None:
    """Many requests with two proposals each from one position's logits: the first token
    is distributed as p_1 and, when the first proposal was accepted, the second as p_2,
    whatever the proposer's distribution (one-hot as n-gram, or a draft model's q)."""
    out, drafts, p = sample_two_positions(params, one_hot, NUM_REQUESTS, device)
    accepted = out[:, 0] == drafts[:, 0]
    assert accepted.sum() > 40_000
    for samples, probs in ((out[:, 0], p[0]), (out[accepted, 1], p[1])):
        stat, df = chi2_statistic(samples, probs)
        critical = chi2_critical(df, FAMILY_ALPHA / NUM_CHECKS)
        assert stat < critical, (stat, df, critical)
        # The samples are enough to see a small bias: against a distribution off by BIAS
        # the same check fails.
        assert chi2_statistic(samples, _biased(probs, BIAS))[0] > critical
