"""Qwen2-VL image preprocessing equals transformers' (PIL backend): sizes through smart_resize's
three branches (round, up to min_pixels, down to max_pixels), RGBA and grayscale input."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from asyncserve.models.qwen2_5_vl_image import (
    ImageProcessorConfig,
    preprocess_image,
    smart_resize,
)

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 16


def random_image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Any:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    data = rng.integers(0, 256, size=(height, width, channels), dtype=np.uint8)
    return Image.fromarray(data[..., 0] if channels == 1 else data, mode=mode)


@pytest.fixture(scope="module")
def hf_processor() -> Any:
    return transformers.Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


@pytest.mark.parametrize(
    "size,mode",
    [
        ((100, 80), "RGB"),
        ((30, 20), "RGB"),
        ((300, 200), "RGB"),
        ((90, 61), "RGBA"),
        ((64, 64), "L"),
    ],
    ids=["round", "up-to-min", "down-to-max", "rgba", "gray"],
)
def test_equals_transformers(hf_processor: Any, size: tuple[int, int], mode: str) -> None:
    image = random_image(*size, mode=mode)
    config = ImageProcessorConfig(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    ours = preprocess_image(image, config)
    expected = hf_processor(images=[image], return_tensors="pt")
    assert ours.grid_thw == tuple(expected["image_grid_thw"][0].tolist())
    torch.testing.assert_close(ours.pixel_values, expected["pixel_values"], rtol=0, atol=1e-6)
    t, h, w = ours.grid_thw
    assert h * 14 * w * 14 <= MAX_PIXELS and h * w * 14 * 14 >= MIN_PIXELS


def test_config_from_preprocessor_json() -> None:
    config = ImageProcessorConfig.from_hf_dict(
        {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "merge_size": 2}
    )
    assert (config.min_pixels, config.max_pixels) == (3136, 12845056)
    newer = ImageProcessorConfig.from_hf_dict(
        {"size": {"shortest_edge": 100, "longest_edge": 9000}}
    )
    assert (newer.min_pixels, newer.max_pixels) == (100, 9000)


def test_bad_images_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(1, 300, 28, MIN_PIXELS, MAX_PIXELS)
    with pytest.raises(ValueError, match="PIL"):
        preprocess_image(np.zeros((4, 4, 3)), ImageProcessorConfig())
