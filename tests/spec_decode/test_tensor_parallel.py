"""N-gram speculation under tensor parallelism: every rank verifies the same proposals."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import save_file

from asyncserve import LLM
from tests.engine.test_tensor_parallel import ENGINE_ARGS, _generate
from tests.models.test_loader import random_state, write_config


def test_tp2_with_ngram_equals_one_device(tmp_path_factory: pytest.TempPathFactory) -> None:
    root: Path = write_config(tmp_path_factory.mktemp("tp-spec") / "llama")
    save_file(random_state(seed=3), str(root / "model.safetensors"))
    single = LLM(str(root), **ENGINE_ARGS)  # type: ignore[arg-type]
    try:
        expected = _generate(single)
    finally:
        single.close()
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 2}  # fmt: skip
    llm = LLM(str(root), tensor_parallel_size=2, speculative_config=spec, **ENGINE_ARGS)  # type: ignore[arg-type]
    try:
        assert _generate(llm) == expected
        assert llm.engine.scheduler.spec_stats.num_drafts > 0
        assert llm.engine.scheduler.num_preemptions_total > 0
    finally:
        llm.close()
