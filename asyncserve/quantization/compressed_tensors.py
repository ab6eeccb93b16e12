"""compressed-tensors checkpoints (`quant_method: "compressed-tensors"`, as llmcompressor
saves them): config groups of weight / input-activation quantization args, each group
targeting "Linear" or regexes over layer names, plus an ignore list.

Supported: float-quantized FP8 weights (strategy tensor, channel or block) with dynamic FP8
activations (per token, or per group for block weights); pack-quantized int4 weights,
symmetric, per group (activation order "weight", or "group" with a g_idx), without
activation quantization (W4A16).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from asyncserve.quantization.base import LinearMethod, QuantConfig, matches_ignored
from asyncserve.quantization.fp8 import Fp8BlockLinearMethod, Fp8ChannelLinearMethod
from asyncserve.quantization.fp8_config import parse_block
from asyncserve.quantization.fp8_moe import Fp8MoEMethod
from asyncserve.quantization.int4 import PackQuantizedLinearMethod


@dataclass(frozen=True)
class _Group:
    targets: tuple[str, ...]
    weights: dict[str, Any]
    activations: dict[str, Any] | None

    def matches(self, prefix: str) -> bool:
        for target in self.targets:
            if target == "Linear":
                return True
            if target.startswith("re:") and re.match(target[3:], prefix):
                return True
            if prefix == target or prefix.endswith("." + target):
                return True
        return False


def _describe(weights: dict[str, Any], activations: dict[str, Any] | None) -> str:
    w = f"{weights.get('type')}{weights.get('num_bits')} {weights.get('strategy')} weights"
    if activations is None:
        return w + " without activation quantization"
    a = f"{activations.get('type')}{activations.get('num_bits')} {activations.get('strategy')}"
    return f"{w} with {'dynamic' if activations.get('dynamic') else 'static'} {a} activations"


@dataclass(frozen=True)
class CompressedTensorsConfig(QuantConfig):
    groups: tuple[_Group, ...]
    ignored: tuple[str, ...]
    name: str = "compressed-tensors"

    @classmethod
    def from_hf(cls, qc: dict[str, Any]) -> CompressedTensorsConfig:
        raw_groups = qc.get("config_groups")
        if not isinstance(raw_groups, dict) or not raw_groups:
            raise ValueError("compressed-tensors quantization_config has no config_groups")
        groups = []
        for key, group in raw_groups.items():
            weights = group.get("weights")
            if not isinstance(weights, dict):
                raise ValueError(f"compressed-tensors config group {key!r} quantizes no weights")
            groups.append(
                _Group(tuple(group.get("targets") or ()), weights, group.get("input_activations"))
            )
            _method_for(groups[-1])  # an unsupported scheme fails at parse time
        return cls(groups=tuple(groups), ignored=tuple(qc.get("ignore") or ()))

    def linear_method(
        self, prefix: str, in_features: int, out_features: int
    ) -> LinearMethod | None:
        if matches_ignored(prefix, self.ignored):
            return None
        parts = _fused_parts(prefix)
        for group in self.groups:
            if all(group.matches(part) for part in parts):
                return _method_for(group)
        return None

    def moe_method(self, prefix: str) -> Fp8MoEMethod | None:
        experts = prefix + ".experts"
        if matches_ignored(experts, self.ignored):
            return None
        for group in self.groups:
            if group.matches(experts):
                method = _method_for(group)
                if isinstance(method, Fp8BlockLinearMethod):
                    return Fp8MoEMethod(method.block, "weight_scale")
                if isinstance(method, Fp8ChannelLinearMethod):
                    return Fp8MoEMethod(per_tensor=method.per_tensor)
                raise ValueError(
                    f"compressed-tensors scheme for MoE experts not supported: "
                    f"{_describe(group.weights, group.activations)} (FP8 experts are)"
                )
        return None

    def uses_fp8(self) -> bool:
        return any(g.weights.get("type") == "float" for g in self.groups)

    def skip_checkpoint_tensor(self, name: str) -> bool:
        # weight_shape records the unpacked shape (the layer knows it); static input scales
        # are not read (activations are quantized dynamically).
        return name.endswith((".weight_shape", ".input_scale"))


def _fused_parts(prefix: str) -> list[str]:
    for fused, parts in (
        ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
        ("gate_up_proj", ("gate_proj", "up_proj")),
    ):
        if prefix.endswith("." + fused):
            return [prefix[: -len(fused)] + part for part in parts]
    return [prefix]


def _method_for(group: _Group) -> LinearMethod:
    w, a = group.weights, group.activations
    if w.get("type") == "float" and w.get("num_bits") == 8:
        if a is None or not a.get("dynamic") or a.get("num_bits") != 8 or a.get("type") != "float":
            raise ValueError(
                f"compressed-tensors scheme not supported: {_describe(w, a)} "
                "(FP8 weights need dynamic FP8 activations)"
            )
        strategy = w.get("strategy")
        if strategy in ("tensor", "channel"):
            return Fp8ChannelLinearMethod(per_tensor=strategy == "tensor")
        if strategy == "block":
            block = parse_block(w.get("block_structure"), "block_structure")
            return Fp8BlockLinearMethod(block, "weight_scale")
    if w.get("type") == "int" and w.get("num_bits") == 4 and a is None:
        return _w4a16_method(w)
    raise ValueError(f"compressed-tensors scheme not supported: {_describe(w, a)}")


def _w4a16_method(w: dict[str, Any]) -> LinearMethod:
    """pack-quantized int4 weights, symmetric, per group (or per channel)."""
    if not w.get("symmetric", True):
        raise ValueError("compressed-tensors W4A16 with asymmetric weights is not supported")
    # "weight" (alias "static") only orders GPTQ's work: the groups stay contiguous. "group"
    # (alias "dynamic") stores each input column's group in weight_g_idx.
    actorder = w.get("actorder")
    if actorder not in (None, False, "weight", "static", "group", "dynamic"):
        raise ValueError(f"compressed-tensors W4A16 actorder {actorder!r} is not supported")
    strategy = w.get("strategy")
    if strategy == "group":
        group = w.get("group_size")
        if not isinstance(group, int) or group < 8 or group % 8:
            raise ValueError(
                f"compressed-tensors group_size must be a multiple of 8, got {group!r}"
            )
        return PackQuantizedLinearMethod(group, act_order=actorder in ("group", "dynamic"))
    raise ValueError(f"compressed-tensors W4A16 strategy {strategy!r} is not supported")
