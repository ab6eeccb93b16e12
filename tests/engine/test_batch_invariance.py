"""A request's greedy output does not depend on its company: batching, chunked prefill,
preemption and prefix-cache hits all give the tokens it gets alone (CPU, fp32)."""

from __future__ import annotations

import random

import pytest

from asyncserve import SamplingParams
from asyncserve.llm import LLM

NUM_TOKENS = 16
PARAMS = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


def make_prompts(llm: LLM) -> list[list[int]]:
    """32 prompts of mixed lengths (5 to ~150 tokens), half sharing a 70-token prefix."""
    tokenizer = llm.get_tokenizer()
    rng = random.Random(0)
    words = "alpha river stone cloud seven green quiet market paper light north".split()
    shared = tokenizer.encode(" ".join(rng.choice(words) for _ in range(70)))[:70]
    prompts = []
    for i in range(32):
        body = tokenizer.encode(" ".join(rng.choice(words) for _ in range(rng.randint(4, 80))))
        prompts.append((shared + body) if i % 2 else body)
    return prompts


@pytest.fixture(scope="module")
def reference() -> tuple[list[list[int]], list[list[int]]]:
    # Alone and one step at a time; the batches below plan ahead (async scheduling, which is
    # off by default on CPU).
    llm = LLM(
        device="cpu",
        enable_prefix_caching=False,
        kv_cache_memory=128 << 20,
        async_scheduling=False,
    )
    prompts = make_prompts(llm)
    alone = [llm.generate([p], PARAMS, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    llm.close()
    return prompts, alone


def run_batch(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
    engine = llm.engine
    assert engine.num_free_blocks == engine.num_total_blocks, "blocks leaked"
    return [o.outputs[0].token_ids for o in outputs]


def test_batched_equals_alone(reference) -> None:  # type: ignore[no-untyped-def]
    prompts, alone = reference
    llm = LLM(
        device="cpu", enable_prefix_caching=False, kv_cache_memory=128 << 20, async_scheduling=True
    )
    assert run_batch(llm, prompts) == alone


def test_small_chunked_prefill_equals_alone(reference) -> None:  # type: ignore[no-untyped-def]
    prompts, alone = reference
    llm = LLM(
        device="cpu",
        enable_prefix_caching=False,
        max_num_batched_tokens=16,
        max_num_seqs=16,
        kv_cache_memory=128 << 20,
        async_scheduling=True,
    )
    assert run_batch(llm, prompts) == alone


def test_preemption_equals_alone(reference) -> None:  # type: ignore[no-untyped-def]
    prompts, alone = reference
    # 24 blocks of 16 tokens: far fewer than 32 requests need at once.
    llm = LLM(
        device="cpu", enable_prefix_caching=False, num_gpu_blocks_override=24, async_scheduling=True
    )
    assert run_batch(llm, prompts) == alone
    assert llm.engine.scheduler.num_preemptions_total > 0


def test_prefix_cache_hits_equal_alone(reference) -> None:  # type: ignore[no-untyped-def]
    prompts, alone = reference
    llm = LLM(
        device="cpu", enable_prefix_caching=True, kv_cache_memory=128 << 20, async_scheduling=True
    )
    assert run_batch(llm, prompts) == alone
    # Second pass: every prompt's full blocks are cached now.
    assert run_batch(llm, prompts) == alone
    assert llm.engine.scheduler.prefix_cache_hits > 0
