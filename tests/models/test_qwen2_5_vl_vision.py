"""The Qwen2.5-VL vision transformer equals transformers' `model.visual` (fp32, CPU): window
and full attention blocks, 2D rotary, patch merger, several images of different grids."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from asyncserve.kernels.ops import REFERENCE_OPS
from asyncserve.models.qwen2_5_vl_vision import (
    Qwen2_5_VisionTransformer,
    VisionConfig,
    window_index,
)
from tests.models.qwen2_5_vl_tiny import VISION, hf_tiny_model

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_model() -> Any:
    return hf_tiny_model()


@pytest.fixture(scope="module")
def ours(hf_model: Any) -> Qwen2_5_VisionTransformer:
    config = VisionConfig.from_hf_dict(hf_model.config.vision_config.to_dict())
    model = Qwen2_5_VisionTransformer(config, REFERENCE_OPS)
    model.load_state_dict(hf_model.model.visual.state_dict())
    return model.eval()


def test_window_index_covers_every_group_once() -> None:
    config = VisionConfig.from_hf_dict(VISION)
    # 10x6 patches: 5x3 merged groups, windows of 2x2 groups -> 3x2 windows, ragged edges.
    order, cu = window_index([(1, 10, 6)], config)
    assert sorted(order.tolist()) == list(range(15))
    assert cu[0] == 0 and cu[-1] == 60
    assert len(cu) - 1 == 6  # windows: 4 + 2 + 4 + 2 + 2 + 1 groups
    assert [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)] == [16, 8, 16, 8, 8, 4]


@pytest.mark.parametrize(
    "grids",
    [[(1, 8, 12)], [(1, 6, 4), (1, 10, 14)], [(2, 4, 4)]],
    ids=["one", "two-sizes", "two-frames"],
)
def test_vision_equals_transformers(
    hf_model: Any, ours: Qwen2_5_VisionTransformer, grids: list[tuple[int, int, int]]
) -> None:
    torch.manual_seed(1)
    patches = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(patches, ours.config.patch_dim)
    with torch.no_grad():
        expected = hf_model.model.visual(pixels, grid_thw=torch.tensor(grids)).pooler_output
        got = ours(pixels, grids)
    assert got.shape == (sum(ours.num_tokens(g) for g in grids), 64)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_bad_pixel_shape_is_a_clear_error(ours: Qwen2_5_VisionTransformer) -> None:
    with pytest.raises(ValueError, match="pixel_values has shape"):
        ours(torch.zeros(10, ours.config.patch_dim), [(1, 4, 4)])


def test_triton_ops_equal_transformers(hf_model: Any) -> None:
    """The GPU kernel set (rotary on the per-patch table, RMSNorm), under Triton's interpreter
    on CPU."""
    pytest.importorskip("triton", reason="triton is not installed")
    from asyncserve.kernels.triton_ops import TRITON_OPS

    config = VisionConfig.from_hf_dict(hf_model.config.vision_config.to_dict())
    model = Qwen2_5_VisionTransformer(config, TRITON_OPS)
    model.load_state_dict(hf_model.model.visual.state_dict())
    grids = [(1, 4, 8)]
    torch.manual_seed(2)
    pixels = torch.randn(32, config.patch_dim)
    with torch.no_grad():
        expected = hf_model.model.visual(pixels, grid_thw=torch.tensor(grids)).pooler_output
        got = model.eval()(pixels, grids)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
