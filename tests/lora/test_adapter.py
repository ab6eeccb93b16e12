"""lora/adapter.py's load_adapter on a real PEFT adapter: the weights it returns against a
plain per-tensor conversion, and a non-finite tensor named by its layer and module."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncserve.lora.adapter import WEIGHTS_NAME, load_adapter
from tests.lora.conftest import TinyLoRA


def _shapes(tensors: dict[str, torch.Tensor]) -> dict[tuple[int, str], tuple[int, int]]:
    """(layer, module) -> (in, out) of the base projections, read off the adapter's A and B."""
    shapes: dict[tuple[int, str], tuple[int, int]] = {}
    for key, tensor in tensors.items():
        if ".lora_A." in key:
            layer = int(key.split("layers.")[1].split(".")[0])
            module = key.split(".lora_A.")[0].rsplit(".", 1)[1]
            out = tensors[key.replace("lora_A", "lora_B")].shape[0]
            shapes[(layer, module)] = (tensor.shape[1], out)
    return shapes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_equal_a_per_tensor_conversion(tiny_lora: TinyLoRA, dtype: torch.dtype) -> None:
    path = tiny_lora.adapters[0].path
    raw = load_file(str(path / WEIGHTS_NAME))
    config = json.loads((path / "adapter_config.json").read_text())
    scaling = config["lora_alpha"] / config["r"]
    loaded = load_adapter("a", str(path), _shapes(raw), 16, dtype)
    assert len(loaded.weights) == len(raw) // 2
    for key, tensor in raw.items():
        if ".lora_A." not in key:
            continue
        layer = int(key.split("layers.")[1].split(".")[0])
        module = key.split(".lora_A.")[0].rsplit(".", 1)[1]
        lora_a, lora_b = loaded.weights[(layer, module)]
        b = raw[key.replace("lora_A", "lora_B")]
        assert torch.equal(lora_a, tensor.to(torch.float32).to(dtype))
        assert torch.equal(lora_b, (b.to(torch.float32) * scaling).to(dtype))
        assert lora_a.dtype == dtype and lora_b.is_contiguous()


def test_non_finite_weight_names_its_layer(tiny_lora: TinyLoRA, tmp_path: Path) -> None:
    src = tiny_lora.adapters[0].path
    shutil.copytree(src, tmp_path / "nan")
    raw = load_file(str(src / WEIGHTS_NAME))
    shapes = _shapes(raw)
    key = next(k for k in raw if "layers.1." in k and "v_proj.lora_B" in k)
    raw[key] = raw[key].clone()
    raw[key][0, 0] = float("nan")
    save_file(raw, str(tmp_path / "nan" / WEIGHTS_NAME))
    with pytest.raises(ValueError, match="layer 1 v_proj holds non-finite weights"):
        load_adapter("nan", str(tmp_path / "nan"), shapes, 16, torch.float32)


def test_overflow_after_scaling_names_its_layer(tiny_lora: TinyLoRA, tmp_path: Path) -> None:
    """A finite B that the adapter's scaling takes past fp32's range is refused too."""
    src = tiny_lora.adapters[0].path
    shutil.copytree(src, tmp_path / "big")
    raw = load_file(str(src / WEIGHTS_NAME))
    key = next(k for k in raw if "layers.0." in k and "o_proj.lora_B" in k)
    raw[key] = raw[key].float().clone()
    raw[key][0, 0] = 3.0e38
    save_file(raw, str(tmp_path / "big" / WEIGHTS_NAME))
    config = json.loads((src / "adapter_config.json").read_text())
    assert config["lora_alpha"] / config["r"] > 1.2  # 3e38 times it overflows
    with pytest.raises(ValueError, match="layer 0 o_proj holds non-finite weights"):
        load_adapter(
            "big",
            str(tmp_path / "big"),
            _shapes(load_file(str(src / WEIGHTS_NAME))),
            16,
            torch.float32,
        )
