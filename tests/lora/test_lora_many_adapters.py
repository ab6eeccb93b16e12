"""Eight adapters at max_loras=8 over a large batch (the W1b-style LoRA benchmark's shape,
scaled down): every request finishes, each adapter is read once, and a step that fails on
the step thread during a LoRA step ends LLM.generate with the error instead of a hang,
with synchronous and with async scheduling."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from asyncserve import LoRARequest, SamplingParams
from asyncserve.llm import LLM
from asyncserve.lora.slots import LoRASlots
from tests.lora.conftest import TinyLoRA

# A hang fails the test instead of blocking the suite.
pytestmark = pytest.mark.timeout(120)
NUM_ADAPTERS = 8
NUM_PROMPTS = 160
NUM_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


def _llm(tiny_lora: TinyLoRA, async_scheduling: bool) -> LLM:
    return LLM(str(tiny_lora.base_path), device="cpu", dtype="float32", block_size=4,
               max_num_seqs=64, max_num_batched_tokens=256, kv_cache_memory=16 << 20,
               enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=16,
               async_scheduling=async_scheduling)  # fmt: skip


def _loras(tiny_lora: TinyLoRA) -> list[LoRARequest]:
    """Eight adapters over the fixture's three folders (distinct ids: distinct adapters)."""
    paths = [a.path for a in tiny_lora.adapters]
    return [LoRARequest(f"ad{i}", i + 1, str(paths[i % len(paths)])) for i in range(NUM_ADAPTERS)]


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, 320, (int(n),), generator=gen).tolist()
            for n in torch.randint(3, 24, (NUM_PROMPTS,), generator=gen)]  # fmt: skip


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def llm(request: Any, tiny_lora: TinyLoRA) -> Iterator[LLM]:
    llm = _llm(tiny_lora, request.param)
    yield llm
    llm.close()


def test_eight_adapters_large_batch(
    llm: LLM, tiny_lora: TinyLoRA, caplog: pytest.LogCaptureFixture
) -> None:
    loras = _loras(tiny_lora)
    prompts = _prompts()
    per_prompt = [loras[i % NUM_ADAPTERS] for i in range(NUM_PROMPTS)]
    with caplog.at_level(logging.INFO, logger="asyncserve.lora.slots"):
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=per_prompt)
    assert len(outputs) == NUM_PROMPTS
    for output in outputs:
        assert output.error is None
        assert len(output.outputs[0].token_ids) == NUM_TOKENS
    # Each adapter read once: eight fit the host cache and the device slots.
    reads = [r for r in caplog.records if "read from" in r.getMessage()]
    assert len(reads) == NUM_ADAPTERS
    # Adapters over the same folder are the same weights: same prompt, same tokens.
    by_prompt = {}
    for i, output in enumerate(outputs):
        key = (tuple(prompts[i]), per_prompt[i].lora_path)
        tokens = output.outputs[0].token_ids
        assert by_prompt.setdefault(key, tokens) == tokens


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_error_on_the_step_thread_ends_generate(
    tiny_lora: TinyLoRA, monkeypatch: pytest.MonkeyPatch, async_scheduling: bool
) -> None:
    """A LoRA step that raises on the step thread fails every request: generate returns
    their errors (it never waits forever)."""
    calls = {"n": 0}
    prepare = LoRASlots.prepare

    def failing_prepare(self: LoRASlots, *args: Any) -> dict[int, str]:
        calls["n"] += 1
        if calls["n"] == 4:  # some steps in: requests running, others waiting
            raise RuntimeError("injected step failure")
        return prepare(self, *args)

    monkeypatch.setattr(LoRASlots, "prepare", failing_prepare)
    llm = _llm(tiny_lora, async_scheduling)
    try:
        loras = _loras(tiny_lora)
        per_prompt = [loras[i % NUM_ADAPTERS] for i in range(NUM_PROMPTS)]
        outputs = llm.generate(_prompts(), GREEDY, use_tqdm=False, lora_request=per_prompt)
    finally:
        llm.close()
    assert calls["n"] >= 4
    assert len(outputs) == NUM_PROMPTS
    assert all(o.error is not None and "injected step failure" in o.error for o in outputs)
