"""The fused MoE tile table: vLLM's file names and format, nearest M, defaults otherwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from asyncserve.kernels import moe_config
from asyncserve.kernels.moe_config import DEFAULT_BUCKETS, MoEConfig, choose_config

H100 = "NVIDIA_H100_80GB_HBM3"


def _entry(block_m: int) -> dict[str, int]:
    return MoEConfig(block_m, 64, 64, 8, 4, 3).to_json()


def _write(path: Path, table: dict[str, dict[str, int]]) -> None:
    path.write_text(json.dumps(table))
    moe_config.load_table.cache_clear()


def test_nearest_m_of_the_shapes_table(tmp_path: Path) -> None:
    name = moe_config.config_file_name(40, 512, H100, "bfloat16")
    assert name == f"E=40,N=512,device_name={H100},dtype=bfloat16.json"
    _write(tmp_path / name, {"1": _entry(16), "64": _entry(32), "1024": _entry(128)})
    block_m = [
        choose_config(t, 40, 512, "bfloat16", H100, tmp_path).block_m
        for t in (1, 20, 40, 500, 700, 100_000)
    ]
    assert block_m == [16, 16, 32, 32, 128, 128]
    # Another shape, dtype or GPU has no table: the default buckets.
    for args in ((8, 512, "bfloat16", H100), (40, 512, "float32", H100), (40, 512, "bfloat16", "")):
        assert choose_config(1, *args, tmp_path) == DEFAULT_BUCKETS[0][1]


def test_gpu_without_a_table_takes_its_same_chip_twins(tmp_path: Path) -> None:
    _write(tmp_path / moe_config.config_file_name(128, 768, H100, "bfloat16"), {"1": _entry(32)})
    assert moe_config.SAME_CHIP["NVIDIA_H200"] == H100
    assert choose_config(1, 128, 768, "bfloat16", "NVIDIA_H200", tmp_path).block_m == 32
    # Its own table comes first; a GPU of another chip keeps the default buckets.
    _write(tmp_path / moe_config.config_file_name(128, 768, "NVIDIA_H200", "bfloat16"),
           {"1": _entry(64)})  # fmt: skip
    assert choose_config(1, 128, 768, "bfloat16", "NVIDIA_H200", tmp_path).block_m == 64
    other_chip = choose_config(1, 128, 768, "bfloat16", "NVIDIA_A100-SXM4-80GB", tmp_path)
    assert other_chip == DEFAULT_BUCKETS[0][1]


def test_vllm_file_without_dtype_serves_16_bit(tmp_path: Path) -> None:
    _write(tmp_path / f"E=8,N=14336,device_name={H100}.json", {"16": _entry(64)})
    assert choose_config(3, 8, 14336, "float16", H100, tmp_path).block_m == 64
    assert choose_config(3, 8, 14336, "float32", H100, tmp_path) == DEFAULT_BUCKETS[0][1]


def test_malformed_table_names_the_file(tmp_path: Path) -> None:
    _write(tmp_path / moe_config.config_file_name(4, 32, H100, "bfloat16"), {"1": {"BLOCK": 1}})
    with pytest.raises(ValueError, match="bad MoE config table .*E=4,N=32"):
        choose_config(1, 4, 32, "bfloat16", H100, tmp_path)


def test_shipped_tables_parse() -> None:
    """Every table in the package loads and holds valid tiles."""
    for path in sorted(moe_config.CONFIG_DIR.glob("*.json")):
        for m, entry in json.loads(path.read_text()).items():
            config = MoEConfig.from_json(entry)
            assert int(m) >= 1 and config.block_m in (16, 32, 64, 128, 256), path.name


def test_names_of_dtype_and_device() -> None:
    assert moe_config.dtype_name(torch.bfloat16) == "bfloat16"
    assert moe_config.device_name(torch.device("cpu")) == ""


@pytest.mark.parametrize("device", [H100, "NVIDIA_H200", ""])
def test_config_change_sizes_reach_every_config(device: str) -> None:
    """The warm-up sizes give every config any batch up to the limit can pick, each once."""
    limit = 5000
    sizes = moe_config.config_change_sizes(limit, 128, 768, "bfloat16", device)
    assert sizes == sorted(sizes) and sizes[0] == 1 and sizes[-1] <= limit
    picked = [choose_config(m, 128, 768, "bfloat16", device) for m in sizes]
    assert len(set(picked)) == len(picked)
    every = {choose_config(m, 128, 768, "bfloat16", device) for m in range(1, limit + 1)}
    assert set(picked) == every
    assert moe_config.config_change_sizes(1, 128, 768, "bfloat16", device) == [1]


def test_config_change_sizes_of_a_table(tmp_path: Path) -> None:
    name = moe_config.config_file_name(40, 512, H100, "bfloat16")
    _write(tmp_path / name, {"1": _entry(16), "64": _entry(32), "1024": _entry(128)})
    # 64 is nearer than 1 from 33 on; 1024 is nearer than 64 from 545 on.
    assert moe_config.config_change_sizes(10_000, 40, 512, "bfloat16", H100, tmp_path) == [
        1,
        33,
        545,
    ]
    assert moe_config.config_change_sizes(100, 40, 512, "bfloat16", H100, tmp_path) == [1, 33]
