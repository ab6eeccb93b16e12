"""Offline LoRA: greedy output with an adapter equals transformers + peft token for token
(fp32); a batch mixing adapters and the base equals each run alone; bad adapters are
refused with a ValueError naming the problem."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from asyncserve import LoRARequest, SamplingParams
from asyncserve.llm import LLM
from tests.lora.conftest import TinyLoRA, edit_config, hf_greedy

NUM_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    # Lengths past a block (4) and the chunk (16): chunked prefill, prefix-cache blocks.
    return [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (5, 19, 33, 9)]


@pytest.fixture(scope="module")
def llm(tiny_lora: TinyLoRA) -> Iterator[LLM]:
    # Two slots for three adapters: a mixed batch evicts; one host copy fewer than needed.
    llm = LLM(
        str(tiny_lora.base_path),
        device="cpu",
        dtype="float32",
        block_size=4,
        max_num_batched_tokens=16,
        kv_cache_memory=8 << 20,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
        max_cpu_loras=2,
    )
    yield llm
    llm.close()


def _requests(tiny_lora: TinyLoRA) -> list[LoRARequest]:
    return [LoRARequest(f"ad{i}", i + 1, str(a.path)) for i, a in enumerate(tiny_lora.adapters)]


def test_greedy_matches_peft(llm: LLM, tiny_lora: TinyLoRA) -> None:
    prompts = _prompts()
    base_out = [hf_greedy(tiny_lora.base, p, NUM_TOKENS) for p in prompts]
    for request, adapter in zip(_requests(tiny_lora), tiny_lora.adapters, strict=True):
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=request)
        for prompt, output in zip(prompts, outputs, strict=True):
            expected = hf_greedy(adapter.model, prompt, NUM_TOKENS)
            assert output.outputs[0].token_ids == expected, (request.lora_name, len(prompt))
        # The adapter changes what the model says.
        assert [o.outputs[0].token_ids for o in outputs] != base_out


def test_mixed_batch_equals_each_alone(llm: LLM, tiny_lora: TinyLoRA) -> None:
    prompts = _prompts()
    loras: list[LoRARequest | None] = [None, *_requests(tiny_lora)]
    alone = [llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora) for lora in loras]
    # Every prompt under every adapter (and none) in one call, interleaved.
    mixed_prompts = [p for p in prompts for _ in loras]
    mixed_loras = [lora for _ in prompts for lora in loras]
    mixed = llm.generate(mixed_prompts, GREEDY, use_tqdm=False, lora_request=mixed_loras)
    for i, output in enumerate(mixed):
        prompt_index, lora_index = divmod(i, len(loras))
        expected = alone[lora_index][prompt_index].outputs[0].token_ids
        assert output.outputs[0].token_ids == expected, (prompt_index, lora_index)


def test_prefix_cache_is_per_adapter(llm: LLM, tiny_lora: TinyLoRA) -> None:
    """The same prompt under another adapter finds no cached blocks; under its own, it does."""
    prompt = list(range(40, 61))  # no other test's prompt: nothing cached yet
    first, second = _requests(tiny_lora)[:2]
    scheduler = llm.engine.scheduler
    llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=first)
    hits = scheduler.prefix_cache_hits
    llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=second)
    assert scheduler.prefix_cache_hits == hits
    llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=first)
    assert scheduler.prefix_cache_hits > hits


def _bad(llm: LLM, path: Path, match: str, lora_id: int = 50) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("bad", lora_id, str(path)))  # fmt: skip


def test_bad_adapters_are_refused(llm: LLM, tiny_lora: TinyLoRA, tmp_path: Path) -> None:
    src = tiny_lora.adapters[0].path
    _bad(llm, tmp_path / "missing", "is not a directory")
    _bad(llm, edit_config(src, tmp_path / "rank", r=32), "max_lora_rank=16")
    _bad(llm, edit_config(src, tmp_path / "embed", target_modules=["embed_tokens"]),
         "target_modules")  # fmt: skip
    _bad(llm, edit_config(src, tmp_path / "alpha", lora_alpha=-1), "lora_alpha")
    _bad(llm, edit_config(src, tmp_path / "type", peft_type="IA3"), "peft_type")
    # A rank that disagrees with the tensors: made for another base (or broken).
    _bad(llm, edit_config(src, tmp_path / "shape", r=4), "base model mismatch")
    (tmp_path / "nojson").mkdir()
    (tmp_path / "nojson" / "adapter_config.json").write_text("{")
    _bad(llm, tmp_path / "nojson", "not valid JSON")
    # An id already taken by another adapter.
    llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora_request=_requests(tiny_lora)[0])
    _bad(llm, tiny_lora.adapters[1].path, "already used", lora_id=1)
    # The engine goes on.
    assert llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_adapter_corrupted_after_eviction_fails_only_its_requests(
    llm: LLM, tiny_lora: TinyLoRA, tmp_path: Path
) -> None:
    """Dropped from the runner's caches, an adapter is read from disk again: corrupted by
    then, its requests fail with the reason and the rest of the batch is unharmed."""
    a, b, _ = tiny_lora.adapters
    shutil.copytree(a.path, tmp_path / "x")
    weights = tmp_path / "x" / "adapter_model.safetensors"
    x = LoRARequest("x", 11, str(tmp_path / "x"))
    prompt = [9, 8, 7, 6, 5]
    assert llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=x)[0].outputs[0].token_ids
    # Two other adapters fill both slots and both host copies: x is read from disk next.
    others = _requests(tiny_lora)[1:]
    llm.generate([prompt] * 2, GREEDY, use_tqdm=False, lora_request=others)
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    outputs = llm.generate([prompt] * 3, GREEDY, use_tqdm=False, lora_request=[None, x, others[0]])
    assert outputs[0].outputs[0].token_ids == hf_greedy(tiny_lora.base, prompt, NUM_TOKENS)
    assert outputs[1].outputs[0].finish_reason == "error"
    assert outputs[1].error is not None and "'x' could not be read" in outputs[1].error
    assert outputs[2].outputs[0].token_ids == hf_greedy(b.model, prompt, NUM_TOKENS)
    # Passing it again loads it again: still unreadable, a ValueError before any work.
    with pytest.raises(ValueError, match="'x' could not be read"):
        llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=x)
    shutil.copyfile(a.path / "adapter_model.safetensors", weights)
    again = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=x)
    assert again[0].outputs[0].token_ids == hf_greedy(a.model, prompt, NUM_TOKENS)


def test_lora_request_needs_enable_lora(tiny_lora: TinyLoRA) -> None:
    llm = LLM(str(tiny_lora.base_path), device="cpu", dtype="float32", kv_cache_memory=4 << 20)
    try:
        with pytest.raises(ValueError, match="enable_lora"):
            llm.generate([[5, 6]], GREEDY, use_tqdm=False,
                         lora_request=_requests(tiny_lora)[0])  # fmt: skip
    finally:
        llm.close()


def test_lora_request_fields() -> None:
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "/tmp")
    with pytest.raises(ValueError, match="lora_name"):
        LoRARequest("", 1, "/tmp")
