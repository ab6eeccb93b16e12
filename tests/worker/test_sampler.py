"""Sampler: greedy, distributions of every filter, seeds, penalties, min_tokens, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from asyncserve.sampling_params import SamplingParams
from asyncserve.worker.sampler import Sampler, SamplerOutput, process_logits
from asyncserve.worker.sampling_metadata import SamplingMetadata, SamplingRow

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# A distribution with no near-ties at the top-p boundaries used below.
PROBS = [0.30, 0.22, 0.16, 0.12, 0.09, 0.06, 0.03, 0.02]
NUM_DRAWS = 20_000


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.param)


def row(
    params: SamplingParams | None = None,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    generator: torch.Generator | None = None,
    stop_token_ids: set[int] | None = None,
) -> SamplingRow:
    return SamplingRow(
        params=params or SamplingParams(),
        prompt_token_ids=prompt or [],
        output_token_ids=output or [],
        generator=generator,
        stop_token_ids=stop_token_ids or set(),
    )


def run(logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
    meta = SamplingMetadata.build(rows, logits.shape[1], logits.device)
    return Sampler()(logits, meta)


def expected_probs(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float
) -> torch.Tensor:
    """Straightforward one-row reference of the filters, in vLLM's order."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    if min_p > 0:
        probs = torch.where(probs >= min_p * probs.max(), probs, 0.0)
        probs /= probs.sum()
    order = probs.argsort(descending=True).tolist()
    if top_k > 0:
        for token in order[top_k:]:
            probs[token] = 0.0
        probs /= probs.sum()
    if top_p < 1.0:
        total = 0.0
        for token in order:
            if total >= top_p:
                probs[token] = 0.0
            total += float(probs[token])
        probs /= probs.sum()
    return probs


def assert_matches(samples: torch.Tensor, expected: torch.Tensor) -> None:
    """Tokens outside the support never appear; frequencies pass a chi-square test."""
    counts = torch.bincount(samples.cpu(), minlength=expected.numel()).double()
    support = expected > 0
    assert counts[~support].sum() == 0, f"disallowed tokens drawn: {counts.tolist()}"
    observed = counts[support]
    wanted = expected[support] * samples.numel()
    chi2 = float(((observed - wanted) ** 2 / wanted).sum())
    dof = int(support.sum()) - 1
    # Far beyond the 99.9th percentile for these degrees of freedom; a wrong distribution
    # with this many draws lands orders of magnitude higher.
    assert chi2 < dof + 6 * math.sqrt(2 * max(dof, 1)) + 6, (chi2, counts.tolist())


def test_greedy_is_argmax(device: torch.device) -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 500, device=device)
    rows = [row(SamplingParams(temperature=0.0, top_k=3, top_p=0.5)) for _ in range(6)]
    out = run(logits, rows)
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None and out.logprob_token_ids is None and out.sampled_ranks is None


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [
        (1.0, 0, 1.0, 0.0),
        (0.6, 0, 1.0, 0.0),
        (1.0, 3, 1.0, 0.0),
        (1.0, 0, 0.75, 0.0),
        (1.0, 0, 1e-9, 0.0),  # top_p keeps at least the best token
        (1.0, 0, 1.0, 0.35),
        (1.4, 5, 0.8, 0.0),
        (0.8, 6, 0.9, 0.1),
    ],
)
def test_distribution_matches_filters(
    device: torch.device, temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    base = torch.tensor(PROBS).log()
    expected = expected_probs(base, temperature, top_k, top_p, min_p)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    torch.manual_seed(1234)
    logits = base.to(device).repeat(NUM_DRAWS, 1)
    samples = run(logits, [row(params) for _ in range(NUM_DRAWS)]).sampled_token_ids
    assert_matches(samples, expected)


def test_tiny_top_p_keeps_the_best_token(device: torch.device) -> None:
    torch.manual_seed(0)
    logits = torch.randn(64, 1000, device=device)
    out = run(logits, [row(SamplingParams(top_p=1e-9)) for _ in range(64)])
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))


def test_rows_keep_their_own_parameters(device: torch.device) -> None:
    """One batch mixing settings: each row is filtered by its own parameters only."""
    base = torch.tensor(PROBS).log()
    top_k_only = [SamplingParams(top_k=2), SamplingParams(top_k=5), SamplingParams()]
    mixed = [*top_k_only, SamplingParams(top_p=0.5, temperature=0.9), SamplingParams(min_p=0.5)]
    # Top-k alone takes the torch.topk path; with top-p in the batch, the sorting path.
    for settings in (top_k_only, mixed):
        check_rows_by_setting(device, base, settings)


def check_rows_by_setting(
    device: torch.device, base: torch.Tensor, settings: list[SamplingParams]
) -> None:
    per_setting = 6_000
    n = len(settings)
    rows = [row(settings[i % n]) for i in range(n * per_setting)]
    torch.manual_seed(7)
    samples = run(base.to(device).repeat(len(rows), 1), rows).sampled_token_ids
    for i, params in enumerate(settings):
        expected = expected_probs(
            base, params.temperature, params.top_k, params.top_p, params.min_p
        )
        assert_matches(samples[i::n], expected)


def test_seeded_row_same_alone_and_anywhere_in_a_batch(device: torch.device) -> None:
    torch.manual_seed(0)
    vocab = 1000
    target = torch.randn(vocab, device=device) * 0.1  # nearly flat: draws vary a lot
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=42)

    def generator(step: int) -> torch.Generator:
        return torch.Generator(device=device).manual_seed(1000 + step)

    alone, in_batch, moved = [], [], []
    for step in range(8):
        alone.append(
            int(run(target[None], [row(seeded, generator=generator(step))]).sampled_token_ids[0])
        )
        others = torch.randn(5, vocab, device=device)
        rows = [
            row(SamplingParams(temperature=0.7, top_k=50)),
            row(SamplingParams(temperature=0.0)),
            row(SamplingParams(seed=7), generator=torch.Generator(device=device).manual_seed(7)),
            row(seeded, generator=generator(step)),
            row(SamplingParams(min_p=0.1)),
            row(SamplingParams(repetition_penalty=1.3), prompt=[1, 2, 3], output=[4]),
        ]
        batch = torch.cat((others[:3], target[None], others[3:]))
        in_batch.append(int(run(batch, rows).sampled_token_ids[3]))
        # The same request as the first row of a different batch.
        rows2 = [rows[3], rows[0], rows[2]]
        rows2[0] = row(seeded, generator=generator(step))
        rows2[2] = row(
            SamplingParams(seed=8), generator=torch.Generator(device=device).manual_seed(8)
        )
        batch2 = torch.cat((target[None], others[:2]))
        moved.append(int(run(batch2, rows2).sampled_token_ids[0]))
    assert alone == in_batch == moved
    assert len(set(alone)) > 4  # really random, not a fixed choice


def test_unseeded_rows_follow_the_global_seed(device: torch.device) -> None:
    logits = torch.zeros(4, 1000, device=device)
    rows = [row() for _ in range(4)]
    torch.manual_seed(3)
    first = run(logits, rows).sampled_token_ids
    torch.manual_seed(3)
    again = run(logits, rows).sampled_token_ids
    second = run(logits, rows).sampled_token_ids
    assert torch.equal(first, again)
    assert not torch.equal(again, second)


def reference_penalties(
    logits: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams
) -> torch.Tensor:
    out = logits.clone()
    for token in set(prompt) | set(output):
        if out[token] > 0:
            out[token] /= params.repetition_penalty
        else:
            out[token] *= params.repetition_penalty
    for token in set(output):
        out[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    return out


def test_penalties_match_reference(device: torch.device) -> None:
    torch.manual_seed(0)
    vocab = 64
    cases = [
        (SamplingParams(repetition_penalty=1.5), [1, 2, 3, 3], [5, 5, 2]),
        (SamplingParams(frequency_penalty=0.7), [1, 9], [4, 4, 4, 8]),
        (SamplingParams(presence_penalty=-0.5), [], [10, 10, 11]),
        (SamplingParams(), [1, 2], [3, 4]),  # no penalty: untouched
        (
            SamplingParams(repetition_penalty=0.8, frequency_penalty=0.3, presence_penalty=1.1),
            [7, 20, 21],
            [20, 30, 30, 63, 0],
        ),
    ]
    logits = torch.randn(len(cases), vocab, device=device) * 3
    rows = [row(p, prompt=pr, output=out) for p, pr, out in cases]
    meta = SamplingMetadata.build(rows, vocab, device)
    assert not meta.no_penalties
    processed = process_logits(logits, meta)
    for i, (params, prompt, output) in enumerate(cases):
        expected = reference_penalties(logits[i].cpu(), prompt, output, params)
        torch.testing.assert_close(processed[i].cpu(), expected)


def test_penalty_changes_greedy_choice(device: torch.device) -> None:
    logits = torch.tensor([[0.0, 5.0, 4.5, 1.0]], device=device)
    greedy = SamplingParams(temperature=0.0, frequency_penalty=0.4)
    assert run(logits, [row(greedy, output=[1])]).sampled_token_ids.tolist() == [1]
    assert run(logits, [row(greedy, output=[1, 1])]).sampled_token_ids.tolist() == [2]


def test_caller_logits_are_not_modified(device: torch.device) -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50, device=device)
    before = logits.clone()
    params = SamplingParams(temperature=0.5, top_k=5, top_p=0.7, min_p=0.1, repetition_penalty=2.0)
    run(logits, [row(params, prompt=[1], output=[2]) for _ in range(3)])
    assert torch.equal(logits, before)


def test_min_tokens_masks_stop_ids(device: torch.device) -> None:
    logits = torch.tensor([[0.0, 1.0, 9.0, 8.0, 2.0]], device=device).repeat(3, 1)
    stops = {2, 3}
    params = SamplingParams(temperature=0.0, min_tokens=3)
    rows = [
        row(params, output=[1], stop_token_ids=stops),  # below min_tokens: 2 and 3 masked
        row(params, output=[1, 1, 1], stop_token_ids=stops),  # reached min_tokens
        row(SamplingParams(temperature=0.0), stop_token_ids=stops),
    ]
    assert run(logits, rows).sampled_token_ids.tolist() == [4, 2, 2]
    # Random rows below min_tokens never draw a stop id, however likely it is.
    random_rows = [row(SamplingParams(min_tokens=2), stop_token_ids=stops) for _ in range(2000)]
    torch.manual_seed(0)
    samples = run(logits[:1].repeat(2000, 1), random_rows).sampled_token_ids
    assert not torch.isin(samples, torch.tensor([2, 3], device=device)).any()
    assert torch.isin(samples, torch.tensor([4], device=device)).any()


def test_logprobs_and_ranks(device: torch.device) -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 300, device=device) * 2
    rows = [
        row(SamplingParams(logprobs=3, temperature=0.5, repetition_penalty=1.8), prompt=[5]),
        row(SamplingParams(logprobs=0, temperature=0.0)),
        row(SamplingParams(temperature=1.5)),
        row(SamplingParams(logprobs=5, top_k=20)),
    ]
    out = run(logits, rows)
    assert out.logprob_token_ids is not None and out.logprobs is not None
    assert out.sampled_ranks is not None
    assert out.logprob_token_ids.shape == (4, 6) and out.logprobs.shape == (4, 6)
    raw = torch.log_softmax(logits, dim=-1)
    sampled = out.sampled_token_ids
    assert torch.equal(out.logprob_token_ids[:, 0], sampled)
    torch.testing.assert_close(out.logprobs[:, 0], raw.gather(1, sampled[:, None])[:, 0])
    top_vals, top_ids = raw.topk(5, dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 1:], top_ids)
    torch.testing.assert_close(out.logprobs[:, 1:], top_vals)
    for i in range(4):
        token = int(sampled[i])
        expected_rank = 1 + int((raw[i] > raw[i, token]).sum())
        assert int(out.sampled_ranks[i]) == expected_rank
    # The greedy row took the best token by raw logprob: rank 1.
    assert int(out.sampled_ranks[1]) == 1


def test_mixed_greedy_and_random_rows(device: torch.device) -> None:
    torch.manual_seed(0)
    vocab = 400
    logits = torch.randn(6, vocab, device=device)
    logits[1::2] = 0.0  # flat rows for the random ones
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 3
    meta = SamplingMetadata.build([row(p) for p in params], vocab, device)
    assert not meta.all_greedy and not meta.all_random and meta.greedy_mask is not None
    draws = [Sampler()(logits, meta).sampled_token_ids for _ in range(10)]
    for d in draws:
        assert torch.equal(d[0::2], logits[0::2].argmax(dim=-1))
    random_tokens = {int(t) for d in draws for t in d[1::2]}
    assert len(random_tokens) > 10


def test_allowed_token_ids(device: torch.device) -> None:
    logits = torch.tensor(PROBS, device=device).log().repeat(4000, 1)
    restricted = SamplingParams(allowed_token_ids=[2, 5, 6])
    rows = [row(SamplingParams(temperature=0.0))] + [row(restricted) for _ in range(3999)]
    meta = SamplingMetadata.build(rows, len(PROBS), device)
    assert meta.allowed_token_mask is not None
    assert bool(meta.allowed_token_mask[0].all())  # an unrestricted row
    torch.manual_seed(0)
    samples = Sampler()(logits, meta).sampled_token_ids
    assert int(samples[0]) == 0
    expected = torch.zeros(len(PROBS), dtype=torch.float64)
    expected[[2, 5, 6]] = torch.tensor([PROBS[2], PROBS[5], PROBS[6]], dtype=torch.float64)
    assert_matches(samples[1:], expected / expected.sum())


def test_logit_bias_forces_and_forbids_tokens(device: torch.device) -> None:
    """+100 makes a token certain; -100 rules one out; rows without a bias are unchanged;
    biases beyond [-100, 100] are clamped, ids past the logits ignored."""
    logits = torch.tensor(PROBS, device=device).log().repeat(4, 1)
    rows = [
        row(SamplingParams(temperature=0.0, logit_bias={5: 100})),
        row(SamplingParams(temperature=0.0, logit_bias={0: -1e6, 99: 50})),
        row(SamplingParams(temperature=0.0)),
        row(SamplingParams(temperature=1.0, seed=3, logit_bias={7: 250.0})),
    ]
    meta = SamplingMetadata.build(rows, len(PROBS), device)
    assert meta.logit_bias_values is not None
    assert meta.logit_bias_values.tolist() == [100.0, -100.0, 100.0]
    out = Sampler()(logits, meta).sampled_token_ids.tolist()
    assert out == [5, 1, 0, 7]


def test_bad_words_rule_out_the_completing_token(device: torch.device) -> None:
    """A one-token bad word is never sampled; a two-token one only after its first token."""
    params = SamplingParams(temperature=0.0)
    params.bad_words_token_ids = [[0], [3, 1]]
    logits = torch.tensor(PROBS, device=device).log().repeat(2, 1)
    rows = [
        SamplingRow(params, [5], [2], None),  # output ends with 2: only [0] applies
        SamplingRow(params, [5], [2, 3], None),  # ends with 3: token 1 completes [3, 1]
    ]
    meta = SamplingMetadata.build(rows, len(PROBS), device)
    assert meta.banned_token_index is not None
    assert sorted(zip(*meta.banned_token_index.tolist(), strict=True)) == [(0, 0), (1, 0), (1, 1)]
    sampled = Sampler()(logits, meta).sampled_token_ids.tolist()
    order = sorted(range(len(PROBS)), key=lambda t: -PROBS[t])
    assert sampled[0] == next(t for t in order if t != 0)
    assert sampled[1] == next(t for t in order if t not in (0, 1))


def test_metadata_leaves_unused_features_off() -> None:
    device = torch.device("cpu")
    greedy = SamplingMetadata.build([row(SamplingParams(temperature=0.0))] * 3, 10, device)
    assert greedy.all_greedy and not greedy.all_random
    assert greedy.temperature is None and greedy.greedy_mask is None
    assert greedy.top_k is None and greedy.top_p is None and greedy.min_p is None
    assert greedy.no_penalties
    assert greedy.banned_token_index is None and greedy.max_num_logprobs is None
    assert greedy.logit_bias_index is None and greedy.logit_bias_values is None

    rows = [
        row(SamplingParams(top_k=100, logprobs=2)),
        row(SamplingParams(top_k=3, seed=1), generator=torch.Generator().manual_seed(1)),
        row(SamplingParams(temperature=0.0, seed=2), generator=torch.Generator().manual_seed(2)),
    ]
    meta = SamplingMetadata.build(rows, 10, device)
    assert meta.all_random is False and meta.all_greedy is False
    assert meta.top_k is not None and meta.top_k.tolist() == [10, 3, 0]
    assert meta.max_top_k == 10
    assert meta.top_p is None and meta.min_p is None and meta.no_penalties
    assert set(meta.generators) == {1}  # a greedy row needs no generator
    assert meta.max_num_logprobs == 2
    assert meta.temperature is not None and meta.temperature.tolist() == [1.0, 1.0, 1.0]
