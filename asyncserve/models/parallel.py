"""Tensor parallelism: which slice of each weight a rank holds, and the collectives that
join the slices (torch.distributed's default group: one worker process per rank).

Column-parallel layers (fused QKV, gate/up, the vocabulary of the embedding and LM head)
hold a slice of the output rows; row-parallel layers (o_proj, down_proj) hold a slice of the
input columns and all-reduce their partial sums. KV heads are split like query heads, or
replicated when there are fewer KV heads than ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from asyncserve.models.arch_config import ArchConfig
from asyncserve.quantization.base import LinearMethod, in_quantized_build

# The families whose layers take a TensorParallel (the others run on one device only).
TP_ARCHITECTURES = frozenset(
    {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "GraniteForCausalLM",
        "Phi3ForCausalLM",
        "Gemma3ForCausalLM",
        "OPTForCausalLM",
        "MixtralForCausalLM",
        "Qwen3MoeForCausalLM",
        "GraniteMoeForCausalLM",
        # Language model sharded, vision encoder replicated (models/multimodal.py).
        "LlavaForConditionalGeneration",
        "Qwen2_5_VLForConditionalGeneration",
    }
)


@dataclass
class FastAllReduce:
    """A faster path for small all-reduces (worker/fast_all_reduce.py), set by the worker once
    the model's dtype is known; `reduce` returns None for what it does not take."""

    reduce: Callable[[torch.Tensor], torch.Tensor | None] | None = None


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in the tensor-parallel group; size 1 makes every collective a no-op.

    expert_parallel: MoE layers place whole experts on ranks instead of slicing every
    expert's intermediate dim (the rest of the model is split as without it)."""

    rank: int = 0
    size: int = 1
    expert_parallel: bool = False
    # The ranks' process group; None: the default (world) group. Pipeline parallelism gives
    # each stage its own.
    group: Any = field(default=None, compare=False, repr=False)
    fast: FastAllReduce = field(default_factory=FastAllReduce, compare=False, repr=False)

    def split(self, total: int) -> tuple[int, int]:
        """(start, size) of this rank's equal share of `total`."""
        per = total // self.size
        return self.rank * per, per

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(first KV head, KV heads) this rank holds: a share of them, or one replicated head
        when the ranks outnumber them."""
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads)
        return self.rank * num_kv_heads // self.size, 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' sum: in place through NCCL/gloo, or a new tensor from the fast path."""
        if self.size > 1:
            if self.fast.reduce is not None:
                summed = self.fast.reduce(x)
                if summed is not None:
                    return summed
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dim (the vocabulary of the logits)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)

    def gather_last_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `x` concatenated along the last dim on the group's first rank (the
        driver, which samples); None on the others, which never hold the whole of it."""
        if self.size == 1:
            return x
        x = x.contiguous()
        first = self._first()
        if self.rank != 0:
            dist.gather(x, None, dst=first, group=self.group)
            return None
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.gather(x, parts, dst=first, group=self.group)
        return torch.cat(parts, dim=-1)

    def _first(self) -> int:
        """The global rank of this group's rank 0."""
        return 0 if self.group is None else dist.get_global_rank(self.group, 0)

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank, in place (the sampled ids: only rank 0 samples)."""
        if self.size > 1:
            dist.broadcast(x, src=self._first(), group=self.group)
        return x


SINGLE = TensorParallel()


def check_tensor_parallel(arch: ArchConfig, size: int, expert_parallel: bool = False) -> None:
    """One-line ValueError when `arch` cannot be split over `size` ranks."""
    if expert_parallel and arch.moe is None:
        raise ValueError(
            f"enable_expert_parallel needs a mixture-of-experts model; {arch.architecture} "
            "has no experts"
        )
    if size == 1:
        return
    if arch.architecture not in TP_ARCHITECTURES:
        raise ValueError(
            f"tensor_parallel_size > 1 is not supported for {arch.architecture} yet "
            f"(supported: {', '.join(sorted(TP_ARCHITECTURES))})"
        )
    heads, kv = arch.num_attention_heads, arch.num_key_value_heads
    if heads % size:
        raise ValueError(
            f"tensor_parallel_size ({size}) must divide the number of attention heads ({heads})"
        )
    if (kv >= size and kv % size) or (kv < size and size % kv):
        raise ValueError(
            f"tensor_parallel_size ({size}) and the number of KV heads ({kv}) must divide one "
            "another"
        )
    moe = arch.moe
    dense_mlp = moe is None or not all(moe.is_sparse(i) for i in range(arch.num_hidden_layers))
    for name in ("intermediate_size", "vocab_size") if dense_mlp else ("vocab_size",):
        value = getattr(arch, name)
        if value % size:
            raise ValueError(f"tensor_parallel_size ({size}) must divide {name} ({value})")
    if arch.moe is not None and expert_parallel and arch.moe.num_experts < size:
        raise ValueError(
            f"expert parallelism needs at least one expert per rank: {arch.moe.num_experts} "
            f"experts, tensor_parallel_size {size}"
        )
    if arch.moe is not None and not expert_parallel and arch.moe.intermediate_size % size:
        raise ValueError(
            f"tensor_parallel_size ({size}) must divide the experts' intermediate size "
            f"({arch.moe.intermediate_size}); or set enable_expert_parallel"
        )


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_slice @ W_slice^T) + b: this rank holds W's columns for its slice of
    the input features (and the whole bias, added once after the sum). Quantized like
    Linear (see layers.Linear): a `quant_method` computes the partial product from this
    rank's slice of the quantized weight and its scales."""

    def __init__(
        self, in_features: int, out_features: int, tp: TensorParallel, bias: bool = False
    ) -> None:
        super().__init__()
        self.tp = tp
        self.in_features = in_features // tp.size  # this rank's slice
        self.out_features = out_features
        device = torch.device("meta") if in_quantized_build() else None
        self.weight = nn.Parameter(
            torch.empty(out_features, self.in_features, device=device), requires_grad=False
        )
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.quant_method: LinearMethod | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            y = self.tp.all_reduce(self.quant_method.apply(self, x, None))
        else:
            y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous slice of the vocabulary's rows; a token outside it looks
    up zeros, and the all-reduce puts every token's row together. Also the (tied) LM head's
    weight: the logits of this rank's vocabulary slice."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_start, per = tp.split(vocab_size)
        self.weight = nn.Parameter(torch.empty(per, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0.0)
        return self.tp.all_reduce(out)
