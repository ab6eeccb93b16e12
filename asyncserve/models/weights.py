"""Filling a model's parameters from HF-named checkpoint tensors.

Each model maps a checkpoint name to a Target: the parameter, and which part of it the
tensor fills (rows of a fused projection, one expert of a stacked expert weight). A
parameter counts as loaded once every element has been written.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Target:
    name: str  # parameter name in the model
    expert: int | None = None  # index into dim 0 of a stacked expert parameter
    rows: tuple[int, int] | None = None  # (start, size) along the next dim
    source_experts: list[int] | None = None  # rows of a stacked source tensor to keep
    offset: float = 0.0  # added on load (Gemma stores norm weights as weight - 1)
    # (dim, start, size): the slice of the checkpoint tensor this tensor-parallel rank holds.
    source: tuple[int, int, int] | None = None


Router = Callable[[str], Target | None]


def _rows_view(
    param: torch.Tensor, view: torch.Tensor, hf_name: str, start: int, size: int
) -> torch.Tensor:
    """The part of `view` holding output rows start..start+size of a fused projection.
    Quantized parameters may run along another dim or hold several rows per entry (block
    scales, packed int4): see quantization.base.set_weight_attrs."""
    dim = getattr(param, "quant_out_dim", 0)
    if dim < 0:
        return view  # not along the outputs: every part of the fused layer fills all of it
    per = getattr(param, "quant_rows_per_entry", 1)
    entries = -(-size // per)
    if start % per or (size % per and start // per + entries != view.shape[dim]):
        raise ValueError(
            f"checkpoint tensor {hf_name!r} fills rows {start}..{start + size} of a fused "
            f"layer, which do not line up with its {per}-row quantization blocks"
        )
    return view.narrow(dim, start // per, entries)


@torch.no_grad()
def load_checkpoint(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], route: Router
) -> set[str]:
    """Copy tensors into the parameters `route` names, converting dtype and device on the
    way. route returns None for a tensor to skip. Raises ValueError on an unknown name, a
    shape mismatch, or a parameter left without a value. Returns the names filled."""
    params = dict(model.named_parameters())
    written: dict[str, int] = {}
    for hf_name, tensor in weights:
        target = route(hf_name)
        if target is None:
            continue
        param = params.get(target.name)
        if param is None:
            raise ValueError(f"checkpoint tensor {hf_name!r} has no place in the model")
        view = param.data
        if target.expert is not None:
            view = view[target.expert]
        if target.rows is not None:
            view = _rows_view(param, view, hf_name, *target.rows)
        if target.source is not None:
            dim, start, size = target.source
            # Readers that slice on read (safetensors) hand over the slice already.
            if tensor.shape[dim] != size:
                tensor = tensor.narrow(dim, start, size)
        if target.source_experts is not None:
            tensor = tensor[target.source_experts]
        if getattr(param, "quant_broadcast", False) and tensor.numel() == 1:
            tensor = tensor.reshape(()).expand(view.shape)  # a per-tensor quantization scale
        if tuple(view.shape) != tuple(tensor.shape):
            raise ValueError(
                f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(view.shape)}"
            )
        view.copy_(tensor.float() + target.offset if target.offset else tensor)
        written[target.name] = written.get(target.name, 0) + view.numel()
    filled = {name for name, count in written.items() if count >= params[name].numel()}
    missing = sorted(set(params) - filled)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} weights: {shown}")
    return filled
