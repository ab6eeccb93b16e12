"""Giving a built model's linear layers their quantization methods, and finishing them once
the weights are in."""

from __future__ import annotations

import torch
from torch import nn

from asyncserve.models.layers import Linear
from asyncserve.models.moe import SparseMoE
from asyncserve.models.parallel import RowParallelLinear
from asyncserve.quantization.base import QuantConfig


def attach_linear_methods(
    model: nn.Module, config: QuantConfig, device: torch.device, dtype: torch.dtype
) -> int:
    """Replace each Linear's meta-device weight (see quantized_build) with its method's
    parameters, or a plain weight where the scheme leaves the layer unquantized. MoE
    routers stay unquantized, as every checkpoint producer leaves them. Returns the number
    of quantized layers."""
    quantized = 0
    for prefix, module in model.named_modules():
        if not isinstance(module, (Linear, RowParallelLinear)):
            continue
        method = None
        if not prefix.endswith(".mlp.gate"):
            method = config.linear_method(prefix, module.in_features, module.out_features)
        if isinstance(module, RowParallelLinear) and method is not None:
            method.check_row_parallel(prefix, module.in_features, module.tp.size)
        del module.weight
        with torch.device(device):
            if method is None:
                shape = (module.out_features, module.in_features)
                module.weight = nn.Parameter(torch.empty(shape, dtype=dtype), False)
            else:
                method.create_weights(module, module.in_features, module.out_features, dtype)
                module.quant_method = method
                quantized += 1
    return quantized + _attach_moe_methods(model, config, device, dtype)


def _attach_moe_methods(
    model: nn.Module, config: QuantConfig, device: torch.device, dtype: torch.dtype
) -> int:
    """The same for the stacked experts of each sparse MoE layer (built on the meta device
    under quantized_build); returns the number of MoE layers quantized."""
    quantized = 0
    for prefix, module in model.named_modules():
        if not isinstance(module, SparseMoE):
            continue
        method = config.moe_method(prefix)
        with torch.device(device):
            if method is None:
                for name in ("w13", "w2"):
                    shape = getattr(module, name).shape
                    setattr(module, name, nn.Parameter(torch.empty(shape, dtype=dtype), False))
            else:
                method.create_weights(module, dtype)
                module.quant_method = method
                quantized += 1
    return quantized


@torch.no_grad()
def process_weights_after_loading(model: nn.Module) -> None:
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(module, (Linear, RowParallelLinear, SparseMoE)) and method is not None:
            method.process_weights_after_loading(module)
