"""The seam between quantization schemes and the models' linear layers.

A QuantConfig (parsed from a checkpoint's `quantization_config` or `--quantization`) picks a
LinearMethod for each linear layer by its name. The method owns the layer's parameters:
it creates them under the checkpoint's tensor names (so the models' name routing works
unchanged), finishes them once the checkpoint is read (repacking, or quantizing an
unquantized checkpoint), and computes the layer's output.

Models build their layers as usual; under `quantized_build()` a Linear's weight is a shape
on the meta device (no memory), and `attach_linear_methods` then gives every Linear its
method and real parameters. Only the Linear class knows about any of this.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

_QUANTIZED_BUILD = contextvars.ContextVar("quantized_build", default=False)


@contextlib.contextmanager
def quantized_build() -> Iterator[None]:
    """While active, Linear layers create their weight on the meta device."""
    token = _QUANTIZED_BUILD.set(True)
    try:
        yield
    finally:
        _QUANTIZED_BUILD.reset(token)


def in_quantized_build() -> bool:
    return _QUANTIZED_BUILD.get()


def set_weight_attrs(
    param: nn.Parameter,
    out_dim: int = 0,
    rows_per_entry: int = 1,
    broadcast: bool = False,
    in_dim: int = 1,
    cols_per_entry: int = 1,
) -> nn.Parameter:
    """How the checkpoint loader maps a fused projection's row range, and a tensor-parallel
    rank's slice of the outputs or inputs, onto this parameter.

    out_dim: the dim that runs along the output features (1 for GPTQ/AWQ's transposed
    layouts; -1: none, each part of a fused layer fills the whole tensor); rows_per_entry:
    output features per entry along it (a block scale's block, eight for int4 packed along
    the outputs); in_dim / cols_per_entry: the same along the input features (-1: none, as
    a per-channel scale; a group or block scale's group, eight for int4 packed along the
    inputs); broadcast: a checkpoint scalar (a per-tensor scale) fills the whole range (the
    shards of a fused layer keep their own scales)."""
    param.quant_out_dim = out_dim  # type: ignore[attr-defined]
    param.quant_rows_per_entry = rows_per_entry  # type: ignore[attr-defined]
    param.quant_in_dim = in_dim  # type: ignore[attr-defined]
    param.quant_cols_per_entry = cols_per_entry  # type: ignore[attr-defined]
    param.quant_broadcast = broadcast  # type: ignore[attr-defined]
    return param


class LinearMethod:
    """One scheme's weights and matmul for a linear layer y = x @ W^T + b."""

    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype
    ) -> None:
        """Register the parameters the checkpoint fills (on the current default device)."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turn the loaded tensors into the form apply() reads (default: as loaded)."""

    def check_row_parallel(self, prefix: str, in_features: int, tp_size: int) -> None:
        """One-line ValueError when a rank's slice of `in_features` inputs (of a row-parallel
        layer) would cut the scheme's groups or blocks (default: any slice works)."""

    @staticmethod
    def check_divides(prefix: str, in_features: int, tp_size: int, unit: int, what: str) -> None:
        if in_features % unit:
            raise ValueError(
                f"{prefix}: tensor_parallel_size {tp_size} gives each rank {in_features} input "
                f"columns, not a multiple of the quantization {what} ({unit})"
            )

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def apply_parts(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """The product's K splits' fp32 partial sums [splits, ..., N] where the scheme's kernel
        for x splits K (a consumer adds them: models/split_sums.py); None elsewhere (the
        caller runs apply)."""
        return None

    def apply_act_and_mul(
        self, layer: nn.Module, x: torch.Tensor, activation: str
    ) -> torch.Tensor | None:
        """A gated MLP's act(gate) * up straight from x, for a gate_up layer whose scheme has
        a kernel that applies the activation to its own sums; None where it has not (the MLP
        then runs apply and the activation kernel)."""
        return None


class QuantConfig:
    """A parsed quantization scheme."""

    name: str = ""

    def linear_method(
        self, prefix: str, in_features: int, out_features: int
    ) -> LinearMethod | None:
        """The method for the linear layer named `prefix`; None leaves it unquantized."""
        raise NotImplementedError

    def moe_method(self, prefix: str) -> Any:
        """The method (quantization/fp8_moe.py) for the experts of the sparse MoE layer named
        `prefix`; None leaves them unquantized."""
        return None

    def uses_fp8(self) -> bool:
        """Whether the scheme needs FP8 matmuls (compute capability >= 8.9 on CUDA)."""
        return False

    def skip_checkpoint_tensor(self, name: str) -> bool:
        """Checkpoint tensors the scheme reads nothing from (e.g. static input scales)."""
        return False

    def filter_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        return ((n, t) for n, t in weights if not self.skip_checkpoint_tensor(n))


def matches_ignored(prefix: str, ignored: Iterable[str]) -> bool:
    """True when `prefix` is in an ignore list: exact or dotted-suffix names, or "re:" regexes
    (compressed-tensors). A fused layer is ignored when any of its parts is."""
    import re

    names = {prefix}
    for fused, parts in (
        ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
        ("gate_up_proj", ("gate_proj", "up_proj")),
    ):
        if prefix.endswith("." + fused):
            names = {prefix[: -len(fused)] + part for part in parts}
    for entry in ignored:
        for name in names:
            if entry.startswith("re:"):
                if re.match(entry[3:], name):
                    return True
            elif name == entry or name.endswith("." + entry):
                return True
    return False
