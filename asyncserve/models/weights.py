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


def param_source(
    param: torch.Tensor,
    source: tuple[int, int, int] | None,
    hf_name: str,
    total_entries: int | None = None,
) -> tuple[int, int, int] | None:
    """A tensor-parallel slice of a checkpoint tensor, (dim, start, size) in output rows (dim
    0) or input columns (dim 1), in the checkpoint tensor's own layout: quantized tensors run
    along other dims or hold several rows or columns per entry (set_weight_attrs). None: the
    rank reads all of it (a per-channel scale of a row-parallel layer, a per-tensor scale).
    Raises ValueError when the slice cuts a quantization group or block; total_entries (the
    tensor's length along the dim) lets the last rank's slice end inside one."""
    if source is None or not hasattr(param, "quant_out_dim"):
        return source
    if getattr(param, "quant_broadcast", False):
        return None
    dim, start, size = source
    axis = (
        ("out_dim", "rows_per_entry", "output row")
        if dim == 0
        else ("in_dim", "cols_per_entry", "input column")
    )
    pdim: int = getattr(param, "quant_" + axis[0])
    per: int = getattr(param, "quant_" + axis[1])
    what = axis[2]
    if pdim < 0:
        return None
    entries = -(-size // per)
    at_end = total_entries is not None and start // per + entries == total_entries
    if start % per or (size % per and total_entries is not None and not at_end):
        raise ValueError(
            f"tensor parallelism splits {hf_name!r} at {what}s {start}..{start + size}, "
            f"inside its {per}-{what} quantization groups: the group/block size must divide "
            "each rank's slice"
        )
    return pdim, start // per, entries


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
        source = param_source(param, target.source, hf_name)
        if source is not None:
            dim, start, size = source
            # Readers that slice on read (safetensors) hand over the slice already.
            if tensor.shape[dim] != size:
                param_source(param, target.source, hf_name, tensor.shape[dim])
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
        if tensor.is_floating_point() != view.is_floating_point():
            # copy_ would convert silently: integer weights, or float ones truncated
            raise ValueError(
                f"checkpoint tensor {hf_name!r} has dtype {tensor.dtype}, expected "
                f"{'a floating-point' if view.is_floating_point() else 'an integer'} dtype "
                f"(the model holds it as {view.dtype})"
            )
        view.copy_(tensor.float() + target.offset if target.offset else tensor)
        written[target.name] = written.get(target.name, 0) + view.numel()
    filled = {name for name, count in written.items() if count >= params[name].numel()}
    missing = sorted(set(params) - filled)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} weights: {shown}")
    return filled
