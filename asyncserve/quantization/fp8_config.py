"""`--quantization fp8` and HF fp8 checkpoints (`quant_method: "fp8"`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncserve.quantization.base import LinearMethod, QuantConfig, matches_ignored
from asyncserve.quantization.fp8 import (
    Fp8BlockLinearMethod,
    Fp8ChannelLinearMethod,
    Fp8OnlineLinearMethod,
)
from asyncserve.quantization.fp8_moe import Fp8MoEMethod


def parse_block(value: Any, field: str) -> tuple[int, int]:
    """[bn, bk] of powers of two (the GEMM's tiles step through whole scale blocks)."""
    if (
        not isinstance(value, list | tuple)
        or len(value) != 2
        or not all(isinstance(v, int) and v >= 16 and v & (v - 1) == 0 for v in value)
    ):
        raise ValueError(f"{field} must be two powers of two >= 16, got {value!r}")
    return int(value[0]), int(value[1])


@dataclass(frozen=True)
class Fp8Config(QuantConfig):
    """serialized: the checkpoint holds fp8 weights (else they are quantized at load)."""

    serialized: bool
    block: tuple[int, int] | None = None
    ignored: tuple[str, ...] = ()
    name: str = "fp8"

    @classmethod
    def online(cls) -> Fp8Config:
        return cls(serialized=False)

    @classmethod
    def from_hf(cls, qc: dict[str, Any]) -> Fp8Config:
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"fp8 activation_scheme {scheme!r} is not supported")
        block = qc.get("weight_block_size")
        ignored = qc.get("ignored_layers") or qc.get("modules_to_not_convert") or []
        return cls(
            serialized=True,
            block=None if block is None else parse_block(block, "weight_block_size"),
            ignored=tuple(ignored),
        )

    def linear_method(
        self, prefix: str, in_features: int, out_features: int
    ) -> LinearMethod | None:
        if matches_ignored(prefix, self.ignored):
            return None
        if self.block is not None:
            return Fp8BlockLinearMethod(self.block, "weight_scale_inv")
        if not self.serialized:
            # torch._scaled_mm needs both dims divisible by 16; such layers stay as they are.
            if in_features % 16 or out_features % 16:
                return None
            return Fp8OnlineLinearMethod()
        return Fp8ChannelLinearMethod(per_tensor=True)

    def moe_method(self, prefix: str) -> Fp8MoEMethod | None:
        if matches_ignored(prefix + ".experts", self.ignored):
            return None
        if self.block is not None:
            return Fp8MoEMethod(self.block, "weight_scale_inv")
        if not self.serialized:
            return Fp8MoEMethod(online=True)
        return Fp8MoEMethod(per_tensor=True)

    def uses_fp8(self) -> bool:
        return True

    def skip_checkpoint_tensor(self, name: str) -> bool:
        # Static input scales: activations are quantized per token at run time instead
        # (at least as accurate as one calibrated scale per tensor).
        return name.endswith(".input_scale")
