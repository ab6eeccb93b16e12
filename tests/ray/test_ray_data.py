"""Ray Data batch inference equals LLM.generate on the same prompts (greedy): vLLM's
distributed.py pattern as written for vLLM, over 2 actors of SmolLM2; the three-line
processor through examples/ray_data_batch.py (text file in, JSONL out), on a small Llama
that loads fast."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray

from asyncserve import LLM, SamplingParams
from asyncserve.ray_data import LLMPredictor, LLMProcessorConfig, build_llm_processor
from tests.conftest import PLAIN_PROMPTS

PARAMS = SamplingParams(temperature=0.0, max_tokens=8)
EXAMPLE = Path(__file__).parents[2] / "examples" / "ray_data_batch.py"


@pytest.fixture(scope="module")
def expected(smollm2_llm: LLM) -> dict[str, str]:
    outputs = smollm2_llm.generate(PLAIN_PROMPTS, PARAMS, use_tqdm=False)
    return {p: out.outputs[0].text for p, out in zip(PLAIN_PROMPTS, outputs, strict=True)}


# The seed's example (vLLM offline_inference/distributed.py) with asyncserve's names.
class SeedPredictor:
    def __init__(self) -> None:
        self.llm = LLM(device="cpu", max_model_len=256, kv_cache_memory=32 << 20)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        outputs = self.llm.generate(batch["text"], PARAMS)
        prompt: list[str] = []
        generated_text: list[str] = []
        for output in outputs:
            prompt.append(output.prompt)  # type: ignore[arg-type]
            generated_text.append(" ".join([o.text for o in output.outputs]))
        return {"prompt": prompt, "generated_text": generated_text}


def test_seed_pattern_over_two_actors_equals_generate(
    ray_cluster: Any, expected: dict[str, str]
) -> None:
    ds = ray.data.from_items([{"text": p} for p in PLAIN_PROMPTS])
    ds = ds.map_batches(SeedPredictor, concurrency=2, batch_size=3, num_cpus=1)
    rows = ds.take_all()
    assert {row["prompt"]: row["generated_text"] for row in rows} == expected


def test_example_writes_jsonl_equal_to_generate(
    ray_cluster: Any, tiny_llama: Path, tmp_path: Path
) -> None:
    # One prompt per line: the multi-line one is left out.
    lines = [p for p in PLAIN_PROMPTS if "\n" not in p]
    llm = LLM(str(tiny_llama), device="cpu")
    try:
        outputs = llm.generate(lines, PARAMS, use_tqdm=False)
    finally:
        llm.close()
    expected = {p: out.outputs[0].text for p, out in zip(lines, outputs, strict=True)}
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(lines) + "\n")
    spec = importlib.util.spec_from_file_location("ray_data_batch", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out = tmp_path / "out"
    example.main(
        [str(prompts), str(out), "--model", str(tiny_llama), "--device", "cpu"]
        + ["--concurrency", "1", "--batch-size", "2", "--max-tokens", "8"]
    )
    rows = [json.loads(line) for f in out.glob("*.json*") for line in f.read_text().splitlines()]
    assert {row["prompt"]: row["generated_text"] for row in rows} == expected


def test_predictor_columns_and_row_params(smollm2_llm: LLM) -> None:
    # The LLM stage in this process (no actor): kept columns, counts, a row's own params.
    predictor = LLMPredictor.__new__(LLMPredictor)
    predictor.llm = smollm2_llm
    predictor.sampling_params = PARAMS
    batch = {
        "prompt": np.array([PLAIN_PROMPTS[0]] * 2),
        "id": np.array([7, 8]),
        "sampling_params": np.array([None, {"temperature": 0.0, "max_tokens": 3}]),
    }
    out = predictor(batch)
    assert out["id"] == [7, 8]
    assert out["num_generated_tokens"] == [8, 3]
    assert out["generated_tokens"][1] == out["generated_tokens"][0][:3]
    assert all(n > 0 for n in out["num_input_tokens"])
    ids = smollm2_llm.get_tokenizer().encode(PLAIN_PROMPTS[0])
    by_ids = predictor({"prompt_token_ids": np.array([ids])})
    assert by_ids["generated_tokens"] == out["generated_tokens"][:1]
    with pytest.raises(ValueError, match="'prompt', 'text' or 'prompt_token_ids' column"):
        predictor({"question": np.array(["?"])})


def test_processor_config_is_checked() -> None:
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        LLMProcessorConfig(concurrency=0)
    with pytest.raises(ValueError, match="model_source"):
        LLMProcessorConfig(engine_kwargs={"model": "x"})
    processor = build_llm_processor(
        LLMProcessorConfig(engine_kwargs={"device": "cpu", "tensor_parallel_size": 2})
    )
    assert processor.resources() == {"num_cpus": 2.0}
