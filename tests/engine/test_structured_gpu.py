"""Structured outputs on the GPU: grammar masks applied to device logits, with CUDA graphs,
in a batch that mixes constrained and free requests (skipped without CUDA).

Uses the qwen3-0.6b benchmark config with dummy weights and its byte-level tokenizer, so it
needs no model files on the device: a random model follows the grammar only if the masks work.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from asyncserve import SamplingParams
from asyncserve.llm import LLM
from asyncserve.sampling_params import StructuredOutputsParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CONFIG = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "qwen3-0.6b"
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["color", "size", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm():  # type: ignore[no-untyped-def]
    engine = LLM(model=str(CONFIG), load_format="dummy", device="cuda", max_model_len=512)
    yield engine
    engine.close()


def test_constrained_and_free_rows_in_one_batch(llm) -> None:  # type: ignore[no-untyped-def]
    def constrained(so: StructuredOutputsParams, **kw: object) -> SamplingParams:
        return SamplingParams(max_tokens=96, structured_outputs=so, **kw)  # type: ignore[arg-type]

    params = [
        constrained(StructuredOutputsParams(json=SCHEMA), temperature=0.0),
        constrained(StructuredOutputsParams(json=SCHEMA), temperature=1.0, seed=3, n=2),
        constrained(StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"), temperature=0.0),
        constrained(StructuredOutputsParams(choice=["yes", "no", "maybe"]), temperature=0.7),
        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
    ]
    prompts = [f"request {i}: answer in the requested format" for i in range(len(params))]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for completion in outputs[0].outputs + outputs[1].outputs:
        assert completion.finish_reason == "stop", completion
        jsonschema.validate(json.loads(completion.text), SCHEMA)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", outputs[2].outputs[0].text)
    assert outputs[3].outputs[0].text in {"yes", "no", "maybe"}
    assert len(outputs[4].outputs[0].token_ids) == 16
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks
