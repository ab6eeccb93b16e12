"""Tile sizes of the fused MoE kernel, per shape and GPU, in vLLM's fused_moe config format.

A table file in kernels/moe_configs/ is named for what it was tuned on, as vLLM names its own:

    E={experts},N={intermediate},device_name={GPU name, spaces as _},dtype={torch dtype}.json

(N is one expert's intermediate size on this rank). It maps a token count M, as a string, to
{"BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages"};
a batch of T tokens uses the entry whose M is nearest T, as vLLM does. vLLM's name for 16-bit
weights (no dtype part) is read as well, so its tuned files can be dropped in unchanged.
benchmarks/tune_moe.py writes these files. A GPU without a table of its own takes one tuned on
a GPU of the same chip and SM count (SAME_CHIP: an H200 reads an H100 SXM's table); a shape
with neither uses the default buckets.
"""

from __future__ import annotations

import functools
import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).with_name("moe_configs")


@dataclass(frozen=True)
class MoEConfig:
    """Tiles of the two grouped GEMMs."""

    block_m: int  # sorted (token, slot) rows per tile; each expert's run is padded to it
    block_n: int
    block_k: int
    group_m: int  # row tiles walked together for L2 reuse of the weight tiles
    num_warps: int
    num_stages: int

    @classmethod
    def from_json(cls, entry: dict[str, int]) -> MoEConfig:
        return cls(
            block_m=int(entry["BLOCK_SIZE_M"]),
            block_n=int(entry["BLOCK_SIZE_N"]),
            block_k=int(entry["BLOCK_SIZE_K"]),
            group_m=int(entry["GROUP_SIZE_M"]),
            num_warps=int(entry["num_warps"]),
            num_stages=int(entry["num_stages"]),
        )

    def to_json(self) -> dict[str, int]:
        return {
            "BLOCK_SIZE_M": self.block_m,
            "BLOCK_SIZE_N": self.block_n,
            "BLOCK_SIZE_K": self.block_k,
            "GROUP_SIZE_M": self.group_m,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
        }


# (most tokens per launch, config) for shapes without a table: the first bucket holding the
# batch is used. vLLM's defaults for bf16 on Hopper.
DEFAULT_BUCKETS: tuple[tuple[int, MoEConfig], ...] = (
    (32, MoEConfig(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=4)),
    (512, MoEConfig(block_m=32, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=4)),
    (1 << 62, MoEConfig(block_m=64, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=4)),
)


# GPU -> a GPU of the same chip with as many SMs (132 on a GH100 in SXM form), whose tuned
# tables fit it better than the default buckets: the tiles' occupancy and shared memory are
# the same; only the memory bandwidth differs.
SAME_CHIP: dict[str, str] = {
    "NVIDIA_H200": "NVIDIA_H100_80GB_HBM3",
    "NVIDIA_H100_NVL": "NVIDIA_H100_80GB_HBM3",
    "NVIDIA_GH200_480GB": "NVIDIA_H100_80GB_HBM3",
}


def device_name(device: torch.device) -> str:
    """The GPU's name as config files spell it (NVIDIA_H100_80GB_HBM3); "" off CUDA."""
    if device.type != "cuda":
        return ""
    return torch.cuda.get_device_name(device).replace(" ", "_")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def config_file_name(num_experts: int, intermediate: int, device: str, dtype: str) -> str:
    return f"E={num_experts},N={intermediate},device_name={device},dtype={dtype}.json"


def _device_table(
    config_dir: Path, num_experts: int, intermediate: int, device: str, dtype: str
) -> dict[int, MoEConfig]:
    """The device's tuned table for the shape, else its SAME_CHIP twin's, else {}."""
    table = load_table(config_dir, num_experts, intermediate, device, dtype)
    if not table and device in SAME_CHIP:
        table = load_table(config_dir, num_experts, intermediate, SAME_CHIP[device], dtype)
    return table


def choose_config(
    num_tokens: int,
    num_experts: int,
    intermediate: int,
    dtype: str,
    device: str,
    config_dir: Path = CONFIG_DIR,
) -> MoEConfig:
    """The tiles for a batch of num_tokens: the nearest M of the device's tuned table (or of
    its SAME_CHIP twin's), else the buckets. dtype and device as dtype_name and device_name
    spell them."""
    table = _device_table(config_dir, num_experts, intermediate, device, dtype)
    if table:
        nearest = min(table, key=lambda m: abs(m - num_tokens))
        return table[nearest]
    for max_tokens, config in DEFAULT_BUCKETS:
        if num_tokens <= max_tokens:
            return config
    return DEFAULT_BUCKETS[-1][1]


def config_change_sizes(
    max_tokens: int,
    num_experts: int,
    intermediate: int,
    dtype: str,
    device: str,
    config_dir: Path = CONFIG_DIR,
) -> list[int]:
    """One token count per distinct config choose_config gives for 1..max_tokens tokens (the
    smallest of each): running a batch of each size compiles every kernel variant a step can
    need, so that none compiles mid-run."""
    table = _device_table(config_dir, num_experts, intermediate, device, dtype)
    # The nearest-M rule changes config only at table keys or midway between them; every
    # bucket starts one past the previous bucket's end.
    candidates = {1, *table, *((a + b) // 2 + 1 for a, b in itertools.pairwise(sorted(table)))}
    candidates |= {end + 1 for end, _ in DEFAULT_BUCKETS[:-1]}
    sizes: dict[MoEConfig, int] = {}
    for m in sorted(n for n in candidates if n <= max_tokens):
        config = choose_config(m, num_experts, intermediate, dtype, device, config_dir)
        sizes.setdefault(config, m)
    return sorted(sizes.values())


@functools.cache
def load_table(
    config_dir: Path, num_experts: int, intermediate: int, device: str, dtype: str
) -> dict[int, MoEConfig]:
    """The tuned table for one shape, {} if none. Read once per shape; a malformed file is
    an error naming it, not a silent fallback."""
    if not device:
        return {}
    names = [config_file_name(num_experts, intermediate, device, dtype)]
    if dtype in ("bfloat16", "float16"):
        names.append(f"E={num_experts},N={intermediate},device_name={device}.json")
    for name in names:
        path = config_dir / name
        if path.is_file():
            try:
                raw = json.loads(path.read_text())
                return {int(m): MoEConfig.from_json(entry) for m, entry in raw.items()}
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"bad MoE config table {path}: {e}") from e
    return {}
