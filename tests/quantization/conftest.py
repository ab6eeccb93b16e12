"""Shared by the quantization tests: greedy continuations of the unquantized SmolLM2."""

from __future__ import annotations

import pytest

from asyncserve.llm import LLM
from asyncserve.outputs import RequestOutput
from asyncserve.sampling_params import SamplingParams
from tests.conftest import PLAIN_PROMPTS

PROMPTS = [*PLAIN_PROMPTS, "The largest planet in the solar system is", "To make a cup of tea,"]
# Eight more, for measures whose noise at 8 x 32 positions is as wide as their margin.
MORE_PROMPTS = [
    "The first law of thermodynamics states that",
    "In Python, a list comprehension",
    "The best way to learn a new language is",
    "Photosynthesis is the process by which",
    "Here is a short poem about the sea:\n",
    "The main causes of the French Revolution were",
    "To sort a list of numbers in C,",
    "A healthy breakfast usually includes",
]


@pytest.fixture(scope="session")
def greedy_reference(smollm2_llm: LLM) -> list[RequestOutput]:
    """8 prompts x 32 greedy tokens of the unquantized model (fp32 on CPU)."""
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    return smollm2_llm.generate(PROMPTS, params, use_tqdm=False)


@pytest.fixture(scope="session")
def wide_greedy_reference(
    smollm2_llm: LLM, greedy_reference: list[RequestOutput]
) -> list[RequestOutput]:
    """16 prompts x 32 greedy tokens: greedy_reference's and MORE_PROMPTS'."""
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    return [*greedy_reference, *smollm2_llm.generate(MORE_PROMPTS, params, use_tqdm=False)]


def greedy_agreement(llm: LLM, reference: list[RequestOutput]) -> tuple[int, int]:
    """(positions, of all) where `llm`, given the reference's prefix, ranks the reference's
    next token first (its prompt logprobs over prompt + continuation)."""
    sequences = [[*out.prompt_token_ids, *out.outputs[0].token_ids] for out in reference]
    scored = llm.generate(
        [{"prompt_token_ids": ids} for ids in sequences],
        SamplingParams(max_tokens=1, prompt_logprobs=0),
        use_tqdm=False,
    )
    agree = total = 0
    for out, other in zip(reference, scored, strict=True):
        assert other.prompt_logprobs is not None
        generated = out.outputs[0].token_ids
        for token, entry in zip(generated, other.prompt_logprobs[-len(generated) :], strict=True):
            assert entry is not None
            agree += entry[token].rank == 1
            total += 1
    return agree, total
