"""GPTQ (`quant_method: "gptq"`) and AWQ (`quant_method: "awq"`) checkpoints, 4-bit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncserve.quantization.base import LinearMethod, QuantConfig, matches_ignored
from asyncserve.quantization.int4 import AWQLinearMethod, GPTQLinearMethod


def _group_size(qc: dict[str, Any], method: str) -> int:
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{method} with {bits} bits is not supported (4 bits only)")
    group = qc.get("group_size", qc.get("q_group_size"))
    if not isinstance(group, int) or group < 8 or group % 8:
        raise ValueError(f"{method} group_size must be a multiple of 8, got {group!r}")
    return group


@dataclass(frozen=True)
class GPTQConfig(QuantConfig):
    group_size: int
    desc_act: bool
    zeros_minus_one: bool
    ignored: tuple[str, ...] = ()
    name: str = "gptq"

    @classmethod
    def from_hf(cls, qc: dict[str, Any]) -> GPTQConfig:
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"gptq checkpoint_format {fmt!r} is not supported")
        return cls(
            group_size=_group_size(qc, "gptq"),
            desc_act=bool(qc.get("desc_act", False)),
            zeros_minus_one=fmt == "gptq",
            ignored=tuple(qc.get("modules_to_not_convert") or ()),
        )

    def linear_method(
        self, prefix: str, in_features: int, out_features: int
    ) -> LinearMethod | None:
        if matches_ignored(prefix, self.ignored):
            return None
        return GPTQLinearMethod(self.group_size, self.desc_act, self.zeros_minus_one)


@dataclass(frozen=True)
class AWQConfig(QuantConfig):
    group_size: int
    ignored: tuple[str, ...] = ()
    name: str = "awq"

    @classmethod
    def from_hf(cls, qc: dict[str, Any]) -> AWQConfig:
        if not qc.get("zero_point", True):
            raise ValueError("awq without zero points is not supported")
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"awq version {version!r} is not supported (gemm only)")
        return cls(
            group_size=_group_size(qc, "awq"),
            ignored=tuple(qc.get("modules_to_not_convert") or ()),
        )

    def linear_method(
        self, prefix: str, in_features: int, out_features: int
    ) -> LinearMethod | None:
        if matches_ignored(prefix, self.ignored):
            return None
        return AWQLinearMethod(self.group_size)
