"""FP8 (e4m3) weights with dynamic FP8 activations.

Three layouts, one per kind of checkpoint:
- channel: one fp32 scale per output row; activations quantized per token. Serves
  `--quantization fp8` on an unquantized checkpoint (quantized here at load), compressed-
  tensors "channel" and "tensor" strategies, and HF fp8 per-tensor checkpoints (a per-tensor
  scale is a per-channel scale with equal rows, which keeps a fused q/k/v layer's three
  scales apart). CUDA: for one token (batch-1 decode) the split-K FP8 GEMV
  (kernels/fp8_gemv.py) on the unquantized activations; for more tokens activations
  quantized per token (Triton), then torch._scaled_mm with row-wise scales; CPU: the
  dequantizing reference (kernels/quant_reference.py).
- block: one scale per [bn, bk] weight tile, activations per token and bk columns
  ("FP8-block" checkpoints: HF `weight_block_size`, compressed-tensors "block").
  CUDA: the Triton block GEMM (kernels/fp8_gemm.py); CPU: the reference.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from asyncserve.kernels import quant_reference as reference
from asyncserve.kernels.quant_reference import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE
from asyncserve.quantization.base import LinearMethod, set_weight_attrs


def quantize_fp8_per_channel(
    weight: torch.Tensor, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (e4m3 [N, K], fp32 scales [N, 1]): each row scaled to the e4m3 range (of
    `amax` [N, 1], the whole row's largest magnitude, when this is a slice of the row)."""
    w = weight.float()
    if amax is None:
        amax = w.abs().amax(dim=1, keepdim=True)
    scale = (amax / FP8_MAX).clamp(min=FP8_MIN_SCALE)
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def check_fp8_device(device: torch.device) -> None:
    """One-line ValueError when `device` cannot run FP8 matmuls (CPU runs the reference)."""
    if device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ValueError(
            f"FP8 quantization needs a GPU with compute capability >= 8.9 (Ada, Hopper); "
            f"{torch.cuda.get_device_name(device)} is sm_{major}{minor}"
        )


def _param(layer: nn.Module, name: str) -> torch.Tensor:
    tensor: torch.Tensor = getattr(layer, name)
    return tensor


def _rowwise_scaled_mm(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """CUDA: x [M, K] (bf16/fp16/fp32) @ (weight * scale)^T with x quantized per token; one
    token (batch-1 decode) takes the FP8 GEMV on x unquantized, whatever the shape."""
    from asyncserve.kernels.fp8_gemm import per_token_group_quant_fp8
    from asyncserve.kernels.fp8_gemv import FP8_GEMV_MAX_TOKENS, fp8_gemv
    from asyncserve.kernels.split_k import GEMV_MAX_TOKENS

    if x.shape[0] <= FP8_GEMV_MAX_TOKENS:
        # One token reads x as it is: no quantization kernel (1.7-3.1 µs of the 12-46 µs
        # of an 8B model's decode linears on an H100, benchmarks/fp8_gemv_bench.py).
        return fp8_gemv(x.contiguous(), weight, None, scale, x.dtype, bias)
    x_q, x_s = per_token_group_quant_fp8(x, x.shape[1])
    if weight.shape[0] % 16 or weight.shape[1] % 16:
        # torch._scaled_mm needs both dims divisible by 16: the GEMV for a few tokens, the
        # reference product for more.
        if x.shape[0] <= GEMV_MAX_TOKENS:
            return fp8_gemv(x_q, weight, x_s, scale, x.dtype, bias)
        return reference.fp8_rowwise_matmul(x_q, weight, x_s, scale, x.dtype, bias)
    # Row-wise scaling gives bf16 out; other dtypes convert after.
    fused_bias = bias if bias is not None and x.dtype == torch.bfloat16 else None
    out = torch._scaled_mm(
        x_q, weight.t(), scale_a=x_s, scale_b=scale.t(), bias=fused_bias, out_dtype=torch.bfloat16
    ).to(x.dtype)
    if bias is not None and fused_bias is None:
        out = out + bias
    return out


def _cpu_fp8_linear(
    layer: nn.Module,
    x: torch.Tensor,
    group: int,
    scale_fn: Callable[[], torch.Tensor],
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """Activations quantized per token group (as on the GPU) and dequantized, times the
    dequantized weight: the same numbers as kernels/quant_reference.py's FP8 matmuls. The fp32
    weight is made once (converting fp8 on the CPU every step costs more than the matmul):
    the CPU path emulates the numerics, it does not save memory."""
    x_q, x_s = reference.per_token_group_quant_fp8(x, group)
    x_dq = x_q.float() * x_s.repeat_interleave(group, 1)[:, : x.shape[1]]
    cached: torch.Tensor | None = getattr(layer, "_dequantized", None)
    if cached is None:
        cached = layer._dequantized = scale_fn()
    out = x_dq @ cached.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


class Fp8ChannelLinearMethod(LinearMethod):
    """FP8 weight [N, K] from the checkpoint with `weight_scale` [N, 1] (per channel) or a
    scalar per checkpoint tensor (per tensor, broadcast over its rows)."""

    def __init__(self, per_tensor: bool) -> None:
        self.per_tensor = per_tensor

    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype
    ) -> None:
        layer.weight = set_weight_attrs(
            nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE), False)
        )
        layer.weight_scale = set_weight_attrs(
            nn.Parameter(torch.empty(out_features, 1, dtype=torch.float32), False),
            broadcast=self.per_tensor,
            in_dim=-1,
        )

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        weight, scale = _param(layer, "weight"), _param(layer, "weight_scale")
        if x.is_cuda:
            out = _rowwise_scaled_mm(x2, weight, scale, bias)
        else:
            out = _cpu_fp8_linear(
                layer,
                x2,
                shape[-1],
                lambda: weight.float() * scale,
                bias,
            )
        return out.view(*shape[:-1], out.shape[-1])


class Fp8OnlineLinearMethod(Fp8ChannelLinearMethod):
    """`--quantization fp8` on an unquantized checkpoint: the weight loads in the model's
    dtype and is quantized per channel once loaded."""

    def __init__(self) -> None:
        super().__init__(per_tensor=False)

    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype
    ) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), False)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = _param(layer, "weight").data
        amax = weight.float().abs().amax(dim=1, keepdim=True)
        tp = getattr(layer, "tp", None)
        if tp is not None and tp.size > 1:
            # A row-parallel rank holds part of each row: scale by the whole row, as one
            # device would, so that every tensor-parallel size serves the same weights.
            torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=tp.group)
        q, scale = quantize_fp8_per_channel(weight, amax)
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)


class Fp8BlockLinearMethod(LinearMethod):
    """FP8 weight [N, K] with one scale per [bn, bk] tile, named as the checkpoint names it
    (`weight_scale_inv` in HF fp8 checkpoints, `weight_scale` in compressed-tensors)."""

    def __init__(self, block: tuple[int, int], scale_name: str) -> None:
        self.block = block
        self.scale_name = scale_name

    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype
    ) -> None:
        bn, bk = self.block
        layer.weight = set_weight_attrs(
            nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE), False)
        )
        scale = torch.empty(-(-out_features // bn), -(-in_features // bk), dtype=torch.float32)
        layer.register_parameter(
            self.scale_name,
            set_weight_attrs(nn.Parameter(scale, False), rows_per_entry=bn, cols_per_entry=bk),
        )

    def check_row_parallel(self, prefix: str, in_features: int, tp_size: int) -> None:
        self.check_divides(prefix, in_features, tp_size, self.block[1], "block's columns")

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        weight, w_scale = _param(layer, "weight"), _param(layer, self.scale_name)
        if x.is_cuda:
            from asyncserve.kernels import fp8_gemm

            x_q, x_s = fp8_gemm.per_token_group_quant_fp8(x2, self.block[1])
            out = fp8_gemm.w8a8_block_fp8_matmul(x_q, weight, x_s, w_scale, self.block, x.dtype)
            if bias is not None:
                out = out + bias
        else:
            out = _cpu_fp8_linear(
                layer,
                x2,
                self.block[1],
                lambda: reference.dequant_fp8_blocks(weight, w_scale, self.block),
                bias,
            )
        return out.view(*shape[:-1], out.shape[-1])
