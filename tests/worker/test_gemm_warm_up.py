"""worker/gemm_warm_up.py: the start-up pass's GEMM shapes run once on a thread beside it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from asyncserve.models.layers import Linear, LMHead
from asyncserve.worker.gemm_warm_up import GemmWarmUp, dense_weights


def small_model(device: str = "cpu") -> nn.Module:
    with torch.device(device):
        model = nn.ModuleDict(
            {
                "qkv": Linear(8, 24),
                "qkv_again": Linear(8, 24),  # the same shape: warmed once
                "down": Linear(16, 8),
                "quantized": Linear(8, 40),
                "head": LMHead(32, 8),
            }
        )
    model["quantized"].quant_method = object()  # type: ignore[assignment]
    return model


def test_one_weight_per_shape_and_none_quantized() -> None:
    shapes = [tuple(w.shape) for w in dense_weights(small_model())]
    assert sorted(shapes) == [(8, 16), (24, 8), (32, 8)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_every_shape_runs_on_the_device() -> None:
    model = small_model("cuda")
    for weight in model.parameters():
        weight.data.normal_()
    warm_up = GemmWarmUp(model, [1, 2, 4, 256], torch.device("cuda"))
    warm_up.join()
    assert warm_up.error is None
    assert warm_up.row_counts == [256, 4, 2, 1]
