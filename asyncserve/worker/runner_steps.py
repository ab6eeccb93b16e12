"""The runner's in-flight step records, and one request's sampling row with the seeded
generator of its sampling step."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from asyncserve.core.step import StepResult
from asyncserve.worker.input_batch import CachedRequestState, StepInputs
from asyncserve.worker.sampling_metadata import SamplingRow

_GOLDEN = 0x9E3779B97F4A7C15


def step_seed(seed: int, num_output_tokens: int) -> int:
    """Seed for one sampling step of a seeded request.

    Derived from the request's seed and how many tokens it has produced, so its random
    stream does not depend on the batch, its row, or a preemption in between.
    """
    return (seed * 1_000_003 + num_output_tokens * _GOLDEN) & ((1 << 63) - 1)


def step_generator(
    state: CachedRequestState, generators: dict[str, torch.Generator], device: torch.device
) -> torch.Generator | None:
    """A seeded request's generator (kept in `generators` across its steps), seeded for
    this step; None for an unseeded or greedy request."""
    seed = state.sampling_params.seed
    if seed is None or state.sampling_params.greedy:
        return None
    gen = generators.get(state.request_id)
    if gen is None:
        gen = torch.Generator(device=device)
        generators[state.request_id] = gen
    gen.manual_seed(step_seed(seed, len(state.output_token_ids)))
    return gen


def sampling_rows(
    states: list[CachedRequestState],
    seeded: np.ndarray,
    generators: dict[str, torch.Generator],
    device: torch.device,
) -> list[SamplingRow]:
    """What the sampler needs of these requests this step: each state's own row, with
    the seeded rows' (`seeded`, a bool per row) generators seeded for this step."""
    rows = [state.sampling_row for state in states]
    for i in np.flatnonzero(seeded).tolist():
        rows[i].generator = step_generator(states[i], generators, device)
    return rows


@dataclass
class LaunchedStep:
    """A step whose forward pass and sampling are enqueued; `collect` finishes it."""

    result: StepResult = field(default_factory=StepResult)
    # Sampled rows, in order: the request's id and state, and where its placeholder sits.
    rows: list[tuple[str, CachedRequestState, int]] = field(default_factory=list)
    # The sampled ids on the device (read by a step launched before this one is collected)
    # and the host copies in flight: ids, top logprob ids, logprobs, ranks.
    sampled: torch.Tensor | None = None
    host: list[torch.Tensor | None] = field(default_factory=list)
    copied: torch.cuda.Event | None = None


@dataclass
class ForwardedStep:
    """A step whose forward pass is enqueued; `launch_sampling` samples from it."""

    inputs: StepInputs | None = None
    # The last hidden states (eager forward) or the sampled rows' logits (replayed graph;
    # this rank's vocabulary slice).
    hidden: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    step: LaunchedStep = field(default_factory=LaunchedStep)
