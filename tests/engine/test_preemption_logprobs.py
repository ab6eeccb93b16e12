"""Preemption by recompute changes no logprobs: a request that loses its KV blocks (mid
prefill or mid decode) and is computed again gets the prompt logprobs and sample logprobs it
gets with a pool large enough for everyone, each prompt position exactly once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors.torch import save_file

from asyncserve import LLM, RequestOutput, SamplingParams
from asyncserve.outputs import LogprobsDict
from tests.models.test_loader import random_state, write_config

# Blocks of 4 tokens and steps of 16 (chunked prefill).
ENGINE_ARGS = {
    "device": "cpu",
    "dtype": "float32",
    "block_size": 4,
    "max_num_batched_tokens": 16,
    "enable_prefix_caching": False,
}
PROMPTS = [list(range(10 + 7 * i, 40 + 7 * i)) for i in range(6)]  # 30 tokens each
PARAMS = SamplingParams(
    temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3, prompt_logprobs=2
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = write_config(tmp_path_factory.mktemp("preempt") / "llama")
    save_file(random_state(seed=5), str(root / "model.safetensors"))
    return root


def _run(checkpoint: Path, num_blocks: int) -> tuple[list[RequestOutput], int]:
    # max_model_len: what the pool holds for one request (a larger one is refused).
    llm = LLM(str(checkpoint), num_gpu_blocks_override=num_blocks,
              max_model_len=min(128, 4 * num_blocks), **ENGINE_ARGS)  # type: ignore[arg-type]  # fmt: skip
    try:
        outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        return outputs, llm.engine.scheduler.num_preemptions_total
    finally:
        llm.close()


@pytest.fixture(scope="module")
def runs(checkpoint: Path) -> Iterator[tuple[list[RequestOutput], list[RequestOutput]]]:
    roomy, roomy_preemptions = _run(checkpoint, num_blocks=128)
    # 16 blocks hold 64 tokens: fewer than two of the six 40-token requests.
    tight, tight_preemptions = _run(checkpoint, num_blocks=16)
    assert roomy_preemptions == 0
    assert tight_preemptions > 0
    yield roomy, tight


def _assert_rows_equal(got: list[LogprobsDict | None], want: list[LogprobsDict | None]) -> None:
    assert len(got) == len(want)
    for got_row, want_row in zip(got, want, strict=True):
        assert (got_row is None) == (want_row is None)
        if got_row is None or want_row is None:
            continue
        assert list(got_row) == list(want_row)
        for token, entry in want_row.items():
            assert got_row[token].rank == entry.rank
            assert got_row[token].logprob == pytest.approx(entry.logprob, abs=1e-4)


def test_prompt_logprobs_survive_preemption(runs) -> None:  # type: ignore[no-untyped-def]
    roomy, tight = runs
    for got, want in zip(tight, roomy, strict=True):
        assert not got.error
        assert got.prompt_logprobs is not None and want.prompt_logprobs is not None
        assert len(got.prompt_logprobs) == len(got.prompt_token_ids)
        assert got.prompt_logprobs[0] is None
        for token, row in zip(got.prompt_token_ids[1:], got.prompt_logprobs[1:], strict=True):
            assert row is not None and token in row
        _assert_rows_equal(got.prompt_logprobs, want.prompt_logprobs)


def test_sample_logprobs_survive_preemption(runs) -> None:  # type: ignore[no-untyped-def]
    roomy, tight = runs
    for got, want in zip(tight, roomy, strict=True):
        (g,), (w,) = got.outputs, want.outputs
        assert g.token_ids == w.token_ids
        assert g.logprobs is not None and w.logprobs is not None
        assert len(g.logprobs) == len(g.token_ids) == PARAMS.max_tokens
        _assert_rows_equal(list(g.logprobs), list(w.logprobs))
        assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-3)
