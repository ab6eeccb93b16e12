"""LoRA around a model's projections: the wrapper layer and the step's adapter groups.

The model's code is untouched: `attach_lora` swaps each decoder layer's q/k/v, o, gate/up
and down projection for a LoRALinear holding the base layer plus one stack of adapter
weights per slot. Every LoRALinear reads the same LoRABatch, which the runner fills once
per step with the batch's rows grouped by adapter slot; its buffers are persistent, so a
captured CUDA graph replays the LoRA kernels with whatever groups the step has.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from asyncserve.kernels import reference
from asyncserve.lora.adapter import ModuleShapes
from asyncserve.models.layers import Linear
from asyncserve.models.parallel import SINGLE, RowParallelLinear, TensorParallel
from asyncserve.worker.input_batch import HostStaging

ShrinkOp = Callable[..., None]
ExpandOp = Callable[..., None]


def lora_ops(device: torch.device) -> tuple[ShrinkOp, ExpandOp]:
    """The shrink / expand pair: Triton on CUDA, the torch reference elsewhere."""
    if device.type == "cuda":
        from asyncserve.kernels import lora

        return lora.lora_shrink, lora.lora_expand
    return reference.lora_shrink, reference.lora_expand


class LoRABatch:
    """This step's rows grouped by adapter slot (see kernels/reference.py for the layout)."""

    def __init__(self, max_tokens: int, num_slots: int, device: torch.device) -> None:
        self.device = device
        self.num_slots = num_slots
        self.sorted_tokens = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        self.group_slots = torch.full((num_slots,), -1, dtype=torch.int32, device=device)
        self.group_starts = torch.zeros(num_slots + 1, dtype=torch.int32, device=device)
        # Whether any row of this step has an adapter (a CPU forward skips LoRA if not).
        self.active = False
        # On CUDA the kernels always run (they return at once for rows without an adapter),
        # so every forward compiles and launches the same kernels: the warm-up before a CUDA
        # graph capture compiles what the graph records.
        self.always = device.type == "cuda"
        self.shrink, self.expand = lora_ops(device)
        # Pinned on CUDA: a pageable copy could wait for the step in flight to finish.
        self.staging = HostStaging(device)

    def set_rows(self, token_slots: np.ndarray) -> None:
        """Group the step's rows ([T] slot per token, -1 for none) by slot."""
        num_tokens = len(token_slots)
        if num_tokens > self.sorted_tokens.shape[0]:
            raise ValueError(
                f"{num_tokens} tokens exceed the LoRA buffers' {self.sorted_tokens.shape[0]}"
            )
        slots = np.full(self.num_slots, -1, dtype=np.int32)
        starts = np.zeros(self.num_slots + 1, dtype=np.int32)
        order = np.argsort(token_slots, kind="stable").astype(np.int32)
        used, counts = np.unique(token_slots, return_counts=True)
        keep = used >= 0
        used, counts = used[keep], counts[keep]
        # Rows without an adapter sort first; the groups start after them.
        first = num_tokens - int(counts.sum())
        slots[: len(used)] = used
        starts[: len(used) + 1] = first + np.concatenate(([0], np.cumsum(counts)))
        starts[len(used) + 1 :] = starts[len(used)]
        self.active = len(used) > 0
        # Stream-ordered after the step in flight, which still reads the old groups.
        order_t, slots_t, starts_t = self.staging.to_device([order, slots, starts])
        self.sorted_tokens[:num_tokens].copy_(order_t)
        self.group_slots.copy_(slots_t)
        self.group_starts.copy_(starts_t)


@dataclass(frozen=True)
class LoRASlice:
    """One adapter target inside a (possibly fused) projection: its `size` rows of the
    output at `offset`, which are rows [b_start, b_start + size) of the target's full
    `full_out` rows (a tensor-parallel rank holds a share of them)."""

    module: str
    offset: int
    size: int
    b_start: int = 0
    full_out: int = 0


Projection = Linear | RowParallelLinear


class LoRALinear(nn.Module):
    """y = base(x) + per row: x @ A[slot]^T @ B[slot]^T for each slice of the output.

    Column-parallel projections (q/k/v, gate/up) keep all of A and their rows of B. A
    row-parallel one (o, down) holds the columns of A for its input features [a_start,
    a_start + in): its partial sum gets the partial LoRA term before the all-reduce, which
    adds both up (sum over ranks of x_r A_r^T B^T = x A^T B^T)."""

    def __init__(
        self,
        base: Projection,
        slices: list[LoRASlice],
        batch: LoRABatch,
        max_rank: int,
        a_start: int = 0,
    ) -> None:
        super().__init__()
        self.base = base
        self.slices = slices
        self.batch = batch
        self.max_rank = max_rank
        weight = base.weight
        self.in_features = weight.shape[1]
        self.a_start = a_start
        self.row_parallel = isinstance(base, RowParallelLinear) and base.tp.size > 1
        num_slots = batch.num_slots
        # The slices share their input: their A matrices stack into one shrink.
        self.lora_a: torch.Tensor
        a = torch.zeros(num_slots, len(slices) * max_rank, self.in_features,
                        dtype=weight.dtype, device=weight.device)  # fmt: skip
        self.register_buffer("lora_a", a, persistent=False)
        for i, s in enumerate(slices):
            b = torch.zeros(num_slots, s.size, max_rank, dtype=weight.dtype, device=weight.device)
            self.register_buffer(f"lora_b_{i}", b, persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def stacks(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slice `index`'s A [S, R, in] (a view into the stack) and B [S, out, R]."""
        rank = self.max_rank
        b: torch.Tensor = getattr(self, f"lora_b_{index}")
        return self.lora_a[:, index * rank : (index + 1) * rank], b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base
        y = F.linear(x, base.weight) if self.row_parallel else base(x)
        batch = self.batch
        if batch.active or batch.always:
            self._add_lora(x.contiguous(), y)
        if self.row_parallel:
            assert isinstance(base, RowParallelLinear)
            return base.tp.all_reduce(y)
        return y

    def _add_lora(self, x: torch.Tensor, y: torch.Tensor) -> None:
        batch = self.batch
        num_tokens = x.shape[0]
        sorted_tokens = batch.sorted_tokens[:num_tokens]
        groups = (batch.group_slots, batch.group_starts)
        rank = self.max_rank
        buf = torch.empty(num_tokens, len(self.slices) * rank, dtype=torch.float32, device=x.device)
        batch.shrink(x, self.lora_a, sorted_tokens, *groups, buf)
        for i, s in enumerate(self.slices):
            b: torch.Tensor = getattr(self, f"lora_b_{i}")
            batch.expand(buf[:, i * rank : (i + 1) * rank], b, sorted_tokens, *groups, y, s.offset)


# (parent module, attribute, layer index, slices, first input column this rank holds)
_Target = tuple[nn.Module, str, int, list[LoRASlice], int]


def _column_slice(module: str, offset: int, size: int, tp: TensorParallel) -> LoRASlice:
    """A column-parallel slice: rank r holds rows [r * size, (r + 1) * size) of the target."""
    return LoRASlice(module, offset, size, tp.rank * size, size * tp.size)


def _targets(model: nn.Module) -> list[_Target]:
    """Every projection LoRA can wrap, with its slices' places in the full adapter."""
    found: list[_Target] = []
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        return found
    tp: TensorParallel = getattr(model, "tp", SINGLE)
    for index, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        if attn is not None:
            qkv = getattr(attn, "qkv_proj", None)
            if isinstance(qkv, Linear | LoRALinear) and hasattr(attn, "q_size"):
                q, kv, head_dim = attn.q_size, attn.kv_size, attn.head_dim
                num_kv_heads = int(attn.num_kv_heads if tp.size == 1 else _kv_heads(model))
                first_kv, _ = tp.kv_heads(num_kv_heads)
                full_kv = num_kv_heads * head_dim
                kv_start = first_kv * head_dim
                found.append((attn, "qkv_proj", index, [
                    _column_slice("q_proj", 0, q, tp),
                    LoRASlice("k_proj", q, kv, kv_start, full_kv),
                    LoRASlice("v_proj", q + kv, kv, kv_start, full_kv)], 0))  # fmt: skip
            o = getattr(attn, "o_proj", None)
            if isinstance(o, Projection | LoRALinear):
                found.append(_row_target(attn, "o_proj", index, o, tp))
        mlp = getattr(layer, "mlp", None)
        if mlp is not None:
            gate_up = getattr(mlp, "gate_up_proj", None)
            if isinstance(gate_up, Linear | LoRALinear) and hasattr(mlp, "intermediate_size"):
                n = mlp.intermediate_size
                found.append((mlp, "gate_up_proj", index, [
                    _column_slice("gate_proj", 0, n, tp),
                    _column_slice("up_proj", n, n, tp)], 0))  # fmt: skip
            down = getattr(mlp, "down_proj", None)
            if isinstance(down, Projection | LoRALinear):
                found.append(_row_target(mlp, "down_proj", index, down, tp))
    return found


def _kv_heads(model: nn.Module) -> int:
    config: Any = getattr(model, "config", None)
    return int(config.num_key_value_heads)


def _row_target(
    parent: nn.Module, attr: str, index: int, module: nn.Module, tp: TensorParallel
) -> _Target:
    weight: torch.Tensor = module.weight  # type: ignore[assignment]
    out, local_in = weight.shape
    a_start = tp.rank * local_in if isinstance(module, RowParallelLinear) else 0
    return parent, attr, index, [LoRASlice(attr, 0, out, 0, out)], a_start


def _full_in(module: nn.Module, tp: TensorParallel) -> int:
    weight: torch.Tensor = module.weight  # type: ignore[assignment]
    local_in = int(weight.shape[1])
    row = isinstance(module, RowParallelLinear) or (
        isinstance(module, LoRALinear) and isinstance(module.base, RowParallelLinear)
    )
    return local_in * tp.size if row else local_in


def module_shapes(model: nn.Module) -> ModuleShapes:
    """(layer, HF module name) -> the full (in_features, out_features) of every target an
    adapter may use (the whole model's, also when this process holds one rank's share)."""
    tp: TensorParallel = getattr(model, "tp", SINGLE)
    shapes: ModuleShapes = {}
    for parent, attr, index, slices, _ in _targets(model):
        in_features = _full_in(getattr(parent, attr), tp)
        for s in slices:
            shapes[(index, s.module)] = (in_features, s.full_out)
    return shapes


# (layer, HF module name) -> the wrapper holding it and the slice index inside it.
LoRATargets = dict[tuple[int, str], tuple[LoRALinear, int]]


def attach_lora(model: nn.Module, batch: LoRABatch, max_rank: int) -> LoRATargets:
    """Wrap every target projection of `model` in a LoRALinear (in place)."""
    targets: LoRATargets = {}
    for parent, attr, index, slices, a_start in _targets(model):
        base = getattr(parent, attr)
        if not isinstance(base, LoRALinear):
            base = LoRALinear(base, slices, batch, max_rank, a_start)
            setattr(parent, attr, base)
        for i, s in enumerate(slices):
            targets[(index, s.module)] = (base, i)
    if not targets:
        raise ValueError(
            f"LoRA is not supported for {type(model).__name__}: no projection to adapt"
        )
    return targets
