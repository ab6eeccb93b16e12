"""PEFT LoRA adapters on disk: adapter_config.json checks and the weights, per layer and module.

An adapter is validated against the model it will run on (target modules, rank, alpha, and
every tensor's shape against the base model's projections) before any request uses it, so
a bad adapter is refused with a ValueError naming the problem and never reaches a step.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

# The projections an adapter may target, as HF Llama-family checkpoints name them.
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
_TENSOR_NAME = re.compile(
    r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$"
)

# (layer index, module name) -> (in_features, out_features) of the base projection.
ModuleShapes = dict[tuple[int, str], tuple[int, int]]


@dataclass
class AdapterConfig:
    rank: int
    alpha: float
    scaling: float
    target_modules: tuple[str, ...]
    base_model: str | None


@dataclass
class LoRAWeights:
    """One adapter's weights: per (layer, module), A [r, in] and B [out, r] with the
    scaling folded into B, so a forward is x @ A^T @ B^T."""

    name: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def _fail(name: str, message: str) -> ValueError:
    return ValueError(f"LoRA adapter {name!r}: {message}")


def read_adapter_config(name: str, path: str, max_rank: int) -> AdapterConfig:
    """adapter_config.json, checked: a LoRA adapter with rank <= max_rank, a valid alpha,
    supported target modules and none of the PEFT features this engine does not run."""
    folder = Path(path)
    config_path = folder / CONFIG_NAME
    # os.path's checks, not Path's: these say False for any OSError (a name too long,
    # a loop), where Path's raise it.
    if not os.path.isdir(folder):
        raise _fail(name, f"path {path!r} is not a directory")
    if not os.path.isfile(config_path):
        raise _fail(name, f"{CONFIG_NAME} not found in {path!r}")
    try:
        raw: Any = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _fail(name, f"{CONFIG_NAME} is not valid JSON: {exc}") from None
    except RecursionError:
        raise _fail(name, f"{CONFIG_NAME} is not valid JSON: nested too deeply") from None
    if not isinstance(raw, dict):
        raise _fail(name, f"{CONFIG_NAME} must hold a JSON object")
    peft_type = str(raw.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise _fail(name, f"peft_type {peft_type!r} is not supported (only LORA)")
    rank = raw.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise _fail(name, f"r (rank) must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise _fail(name, f"rank r={rank} exceeds max_lora_rank={max_rank}")
    alpha = raw.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha > 0:
        raise _fail(name, f"lora_alpha must be a positive number, got {alpha!r}")
    if not math.isfinite(alpha):
        raise _fail(name, f"lora_alpha must be finite, got {alpha!r}")
    for key, allowed in (("bias", (None, "none")), ("use_dora", (None, False)),
                         ("fan_in_fan_out", (None, False))):  # fmt: skip
        if raw.get(key) not in allowed:
            raise _fail(name, f"{key}={raw.get(key)!r} is not supported")
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern"):
        if raw.get(key):
            raise _fail(name, f"{key} is not supported (got {raw.get(key)!r})")
    targets = raw.get("target_modules")
    if isinstance(targets, str):
        target_modules: tuple[str, ...] = ()  # a regex: the tensors say what it matched
    elif isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets):
        target_modules = tuple(t.rsplit(".", 1)[-1] for t in targets)
        bad = [t for t in target_modules if t not in SUPPORTED_MODULES]
        if bad:
            raise _fail(
                name,
                f"target_modules {bad} are not supported (supported: {', '.join(SUPPORTED_MODULES)})",
            )
    else:
        raise _fail(name, f"target_modules must be a non-empty list or a regex, got {targets!r}")
    scaling = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    base = raw.get("base_model_name_or_path")
    return AdapterConfig(rank, float(alpha), scaling, target_modules, base if base else None)


def _tensor_key(name: str, tensor_name: str) -> tuple[int, str, str]:
    match = _TENSOR_NAME.search(tensor_name)
    if match is None or match.group(2) not in SUPPORTED_MODULES:
        raise _fail(name, f"tensor {tensor_name!r} is not a LoRA weight of a supported module")
    return int(match.group(1)), match.group(2), match.group(3)


def _check_shapes(
    name: str,
    config: AdapterConfig,
    shapes: dict[tuple[int, str, str], tuple[int, ...]],
    modules: ModuleShapes,
) -> None:
    base = f" (the adapter was made for {config.base_model!r})" if config.base_model else ""
    if not shapes:
        raise _fail(name, f"{WEIGHTS_NAME} holds no LoRA weights")
    for (layer, module, which), shape in shapes.items():
        if (layer, module) not in modules:
            raise _fail(
                name, f"base model mismatch: layer {layer} {module} is not in the model{base}"
            )
        other = "B" if which == "A" else "A"
        if (layer, module, other) not in shapes:
            raise _fail(name, f"layer {layer} {module} has lora_{which} but no lora_{other}")
        in_features, out_features = modules[(layer, module)]
        expected = (config.rank, in_features) if which == "A" else (out_features, config.rank)
        if tuple(shape) != expected:
            raise _fail(
                name,
                f"base model mismatch: layer {layer} {module} lora_{which} has shape "
                f"{list(shape)}, the model needs {list(expected)} (rank {config.rank}){base}",
            )


def check_adapter_files(name: str, path: str) -> None:
    """The files of an adapter loaded earlier are still there (the runner reads them on first
    use and after evicting it from its cache): a cheap check before a request uses it."""
    folder = Path(path)
    for file in (CONFIG_NAME, WEIGHTS_NAME):
        if not os.path.isfile(folder / file):
            raise _fail(name, f"{file} is gone from {path!r} since the adapter was loaded")


def _open(name: str, path: str) -> Any:
    weights_path = Path(path) / WEIGHTS_NAME
    if not os.path.isfile(weights_path):
        raise _fail(name, f"{WEIGHTS_NAME} not found in {path!r}")
    try:
        return safe_open(str(weights_path), framework="pt", device="cpu")
    except (SafetensorError, OSError) as exc:
        raise _fail(name, f"{WEIGHTS_NAME} cannot be read: {exc}") from None


def load_adapter(
    name: str,
    path: str,
    modules: ModuleShapes,
    max_rank: int,
    dtype: torch.dtype,
    pin_memory: bool = False,
) -> LoRAWeights:
    """Validate and load an adapter into CPU tensors of `dtype` (scaling folded into B);
    with pin_memory, in page-locked memory (a slot fill is then an asynchronous copy)."""
    config = read_adapter_config(name, path, max_rank)
    tensors: dict[tuple[int, str, str], torch.Tensor] = {}
    with _open(name, path) as handle:
        for key in handle.keys():  # noqa: SIM118
            tensors[_tensor_key(name, key)] = handle.get_tensor(key)
    _check_shapes(name, config, {k: tuple(t.shape) for k, t in tensors.items()}, modules)
    keys = [(layer, module) for (layer, module, which) in tensors if which == "A"]
    shapes_a = [tensors[(*key, "A")].shape for key in keys]
    shapes_b = [tensors[(*key, "B")].shape for key in keys]
    # All A's in one buffer and all B's in another, each converted, scaled and checked in a
    # few whole-buffer operations: a few thousand small ones per adapter cost minutes on a
    # host whose cores are busy (every one waits for the intra-op thread pool).
    flat_a = _flat(tensors[(*key, "A")] for key in keys)
    flat_b = _flat(tensors[(*key, "B")] for key in keys)
    flat_b.mul_(config.scaling)
    if not bool(torch.isfinite(flat_a).all() & torch.isfinite(flat_b).all()):
        pairs = zip(_unflatten(flat_a, shapes_a), _unflatten(flat_b, shapes_b), strict=True)
        layer, module = next(
            key
            for key, (a, b) in zip(keys, pairs, strict=True)
            if not bool(torch.isfinite(a).all() & torch.isfinite(b).all())
        )
        raise _fail(name, f"layer {layer} {module} holds non-finite weights")
    out_a, out_b = flat_a.to(dtype), flat_b.to(dtype)
    if pin_memory:
        out_a, out_b = out_a.pin_memory(), out_b.pin_memory()
    pairs = zip(_unflatten(out_a, shapes_a), _unflatten(out_b, shapes_b), strict=True)
    return LoRAWeights(name, config.rank, dict(zip(keys, pairs, strict=True)))


def _flat(parts: Any) -> torch.Tensor:
    """The tensors end to end in one new float32 buffer (one copy, one conversion)."""
    return torch.cat([part.reshape(-1) for part in parts]).to(torch.float32)


def _unflatten(flat: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    """Views of `flat` in the given shapes, in order."""
    sizes = [math.prod(shape) for shape in shapes]
    return [part.view(shape) for part, shape in zip(flat.split(sizes), shapes, strict=True)]
