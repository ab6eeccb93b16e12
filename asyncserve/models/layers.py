"""Building blocks of decoder-only models: linear, norms, rotary, gated MLP, embedding.

Parameters are created uninitialised (torch.empty) on the current default device and dtype:
every weight is either loaded or filled by the dummy initialiser, so an init pass would be
wasted work (seconds for an 8B model). Layer classes stay small so that tensor-parallel
versions can replace them one by one.
"""

from __future__ import annotations

import math
from typing import Any, overload

import torch
import torch.nn.functional as F
from torch import nn

from asyncserve.kernels.ops import KernelOps
from asyncserve.models.parallel import SINGLE, RowParallelLinear, TensorParallel
from asyncserve.models.split_sums import SplitSums
from asyncserve.quantization.base import LinearMethod, in_quantized_build


class Linear(nn.Module):
    """y = x @ W^T + b with W stored [out_features, in_features], as HF checkpoints store it.

    A quantized model's layers get a `quant_method` (asyncserve/quantization), which owns
    the weight's parameters and computes the product; until then, under a quantized build,
    the weight is only a shape on the meta device."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        device = torch.device("meta") if in_quantized_build() else None
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, device=device), requires_grad=False
        )
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.quant_method: LinearMethod | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, self.bias)
        return F.linear(x, self.weight, self.bias)


def linear_parts(layer: nn.Module, x: torch.Tensor) -> torch.Tensor | SplitSums:
    """layer(x), or its split-K partial sums where its quantization scheme leaves them
    (apply_parts; models/split_sums.py); plain Linear layers only (LoRA and tensor-parallel
    wrappers add to or reduce the output)."""
    if type(layer) is Linear and layer.quant_method is not None and layer.bias is None:
        parts = layer.quant_method.apply_parts(layer, x)
        if parts is not None:
            return SplitSums(parts, x.dtype)
    out: torch.Tensor = layer(x)
    return out


class RMSNorm(nn.Module):
    """RMSNorm; with a residual it adds first and returns (normed, new residual), as vLLM's."""

    def __init__(self, hidden_size: int, eps: float, ops: KernelOps) -> None:
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    @overload
    def forward(self, x: torch.Tensor | SplitSums, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(
        self, x: torch.Tensor | SplitSums, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor | SplitSums, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if isinstance(x, SplitSums):
            if residual is not None:  # the projection's split sum in this kernel
                return self.ops.add_parts_rms_norm(x.parts, residual, self.weight, self.eps)
            x = x.dense()
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias (OPT)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


def _inv_freq(head_dim: int, base: float) -> torch.Tensor:
    # Same expression as HF, so the cache is bit-identical to its rotary embedding.
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    return 1.0 / (base**exponent)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths slowed by `factor`, short ones kept, a
    smooth blend in between (HF's _compute_llama3_parameters)."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def compute_cos_sin_cache(
    head_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict[str, Any] | None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """[max_position, head_dim]: cos(pos * f) in the first half, sin in the second."""
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    if max_position < 1:
        raise ValueError(f"max_position must be >= 1, got {max_position}")
    rope_type = None
    if rope_scaling is not None:
        rope_type = rope_scaling.get("rope_type") or rope_scaling.get("type")
    inv_freq = _inv_freq(head_dim, base)
    positions = torch.arange(max_position, dtype=torch.float32)
    if rope_type == "longrope":
        assert rope_scaling is not None
        return _longrope_cache(head_dim, base, positions, rope_scaling).to(dtype)
    if rope_scaling is None or rope_type in (None, "default"):
        pass
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
    elif rope_type == "linear":
        inv_freq = inv_freq / float(rope_scaling["factor"])
    else:
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported")
    freqs = torch.outer(positions, inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


def _longrope_cache(
    rotary_dim: int, base: float, positions: torch.Tensor, scaling: dict[str, Any]
) -> torch.Tensor:
    """LongRoPE (Phi-3): per-frequency factors, the short ones within the original context
    and the long ones past it, and cos/sin scaled by the attention factor.

    HF switches the whole sequence to the long factors once it outgrows the original context
    (its Phi-3 generate drops the KV cache at that point and recomputes every key); a paged
    cache keeps its keys, so here the switch is per position: positions past the original
    context use the long factors, earlier ones keep the short. Equal to HF for sequences
    within the original context (4096 tokens for Phi-3-mini).
    """
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    tables = []
    for key in ("short_factor", "long_factor"):
        factors = torch.tensor(scaling[key], dtype=torch.float32)
        if factors.numel() != rotary_dim // 2:
            raise ValueError(
                f"longrope {key} has {factors.numel()} entries, need {rotary_dim // 2}"
            )
        inv_freq = 1.0 / (factors * base**exponent)  # HF's expression, for identical tables
        tables.append(torch.outer(positions, inv_freq))
    long_ctx = positions[:, None] >= scaling["original_max_position_embeddings"]
    freqs = torch.where(long_ctx, tables[1], tables[0])
    mscale = float(scaling["attention_factor"])
    return torch.cat((freqs.cos() * mscale, freqs.sin() * mscale), dim=-1)


class RotaryEmbedding(nn.Module):
    """NeoX-style rotary embedding over a precomputed fp32 cos/sin table."""

    cos_sin_cache: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        rope_scaling: dict[str, Any] | None,
        ops: KernelOps,
    ) -> None:
        super().__init__()
        self.ops = ops
        cache = compute_cos_sin_cache(head_dim, max_position, base, rope_scaling)
        # Not persistent: derived from the config, never part of a checkpoint.
        self.register_buffer("cos_sin_cache", cache.to(torch.empty(0).device), persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.rotary_embedding(positions, query, key, self.cos_sin_cache)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one projection; act is SiLU
    or, for Gemma, GELU with the tanh approximation."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        ops: KernelOps,
        activation: str = "silu",
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.ops = ops
        # Column-parallel gate/up, row-parallel down: one all-reduce per MLP.
        self.intermediate_size = intermediate_size // tp.size
        self.gate_up_proj = Linear(hidden_size, 2 * self.intermediate_size)
        self.down_proj: Linear | RowParallelLinear
        if tp.size == 1:
            self.down_proj = Linear(intermediate_size, hidden_size)
        else:
            self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp)
        self.activation = activation
        if activation == "silu":
            self.act_and_mul = ops.silu_and_mul
        elif activation == "gelu_pytorch_tanh":
            self.act_and_mul = ops.gelu_tanh_and_mul
        else:
            raise ValueError(f"MLP activation {activation!r} is not supported")
        # Set where a fused add-norm takes down_proj's output (models/split_sums.py).
        self.split_output = False

    def forward(self, x: torch.Tensor) -> torch.Tensor | SplitSums:
        gate_up = self.gate_up_proj
        # A quantized gate_up whose decode kernel applies the activation to its own sums (the
        # int4 GEMV): one kernel fewer a layer. Not under LoRA, whose wrapper adds to gate_up's
        # output.
        act = None
        if type(gate_up) is Linear and gate_up.quant_method is not None:
            act = gate_up.quant_method.apply_act_and_mul(gate_up, x, self.activation)
        if act is None:
            act = self.act_and_mul(gate_up(x))
        if self.split_output:
            return linear_parts(self.down_proj, act)
        out: torch.Tensor = self.down_proj(act)
        return out


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Hidden states -> fp32 logits. Tied models point `weight` at the embedding's weight by
    using the embedding module itself as the head (see LlamaForCausalLM)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)


_HALF = (torch.bfloat16, torch.float16)


def compute_logits(hidden: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
    """[N, hidden] @ head^T -> [N, vocab] float32. On CUDA with 16-bit weights the GEMM writes
    its fp32 accumulators itself: no second kernel widening a rounded [N, vocab] copy (at
    256 rows of Qwen3's 152k vocabulary that copy took 67 us a step)."""
    if (
        hidden.is_cuda
        and hidden.dim() == 2
        and hidden.dtype in _HALF
        and head_weight.dtype == hidden.dtype
    ):
        return torch.mm(hidden, head_weight.t(), out_dtype=torch.float32)
    return F.linear(hidden, head_weight).float()
