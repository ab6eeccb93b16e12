"""Async scheduling on the real model (CPU): planning each step before the last one's tokens
are back changes no output, whatever the request asks for (grammars and penalties included,
whose sampling waits for the last step's tokens)."""

from __future__ import annotations

import pytest

from asyncserve import SamplingParams
from asyncserve.llm import LLM
from asyncserve.sampling_params import StructuredOutputsParams


def _prompts_and_params(llm: LLM) -> tuple[list[list[int]], list[SamplingParams]]:
    tokenizer = llm.get_tokenizer()
    texts = [
        "The capital of France is",
        "List three colors:",
        "def fibonacci(n):",
        "Once upon a time",
        "The quick brown fox",
        "Water boils at",
        "The year the tower was built:",
    ]
    prompts = [tokenizer.encode(t) for t in texts]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24),  # may stop on EOS
        SamplingParams(temperature=0.0, max_tokens=20, stop=["\n"]),  # stop string
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=1.3),  # needs tokens
        SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, min_tokens=6),
        SamplingParams(temperature=0.7, seed=3, max_tokens=10, n=2, ignore_eos=True),
        # A grammar: while it runs, sampling waits for the tokens the matcher must see.
        SamplingParams(
            temperature=0.0,
            max_tokens=12,
            structured_outputs=StructuredOutputsParams(regex=r"[a-z]+ [0-9]{2,4}\."),
        ),
    ]
    return prompts, params


def _run(
    async_scheduling: bool, num_blocks: int | None = None, min_preemptions: int = 0
) -> list[list[tuple]]:
    llm = LLM(
        device="cpu",
        # A small pool holds one request of at most its blocks' tokens.
        max_model_len=512 if num_blocks is None else 16 * num_blocks,
        kv_cache_memory=64 << 20,
        num_gpu_blocks_override=num_blocks,
        async_scheduling=async_scheduling,
    )
    prompts, params = _prompts_and_params(llm)
    engine = llm.engine
    # Steps launched while the one before was still in flight (never one at a time).
    overlapped = 0
    launch = engine.step_loop._launch

    async def counting(loop, plan, prev):  # type: ignore[no-untyped-def]
        nonlocal overlapped
        overlapped += prev is not None
        return await launch(loop, plan, prev)

    engine.step_loop._launch = counting  # type: ignore[method-assign]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert engine.num_free_blocks == engine.num_total_blocks, "blocks leaked"
    assert (overlapped > 0) == async_scheduling
    assert engine.scheduler.num_preemptions_total >= min_preemptions
    runs = [
        [
            (c.text, c.token_ids, c.finish_reason, [sorted(lp) for lp in c.logprobs or []])
            for c in o.outputs
        ]
        for o in outputs
    ]
    llm.close()
    return runs


@pytest.fixture(scope="module")
def one_step_at_a_time() -> list[list[tuple]]:
    return _run(async_scheduling=False)


def test_async_scheduling_changes_no_output(one_step_at_a_time: list[list[tuple]]) -> None:
    assert _run(async_scheduling=True) == one_step_at_a_time


def test_async_scheduling_with_preemption_changes_no_output(
    one_step_at_a_time: list[list[tuple]],
) -> None:
    # 5 blocks of 16 tokens for 7 sequences of 12 to 29 tokens: preemptions happen.
    assert _run(async_scheduling=True, num_blocks=5, min_preemptions=1) == one_step_at_a_time
