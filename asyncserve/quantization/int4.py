"""4-bit weight-only quantization (W4A16): compressed-tensors pack-quantized, GPTQ and AWQ.

Each format's tensors load under their checkpoint names and layouts, then are converted
once to one layout (kernels/quant_reference.py): qweight int32 [N, K / 8] with unsigned nibbles
along K, scales and zeros [N, groups] with w = (q - zero) * scale, and g_idx [K] for
act-order checkpoints. The published layouts:
- compressed-tensors: weight_packed int32 [N, K / 8], nibble i = column 8j + i, values
  offset by 8 (symmetric: zero 8); weight_scale [N, groups].
- GPTQ: qweight int32 [K / 8, N] (nibble i of row j = input 8j + i); qzeros int32
  [groups, N / 8] (nibble i = output 8j + i), stored minus one in the original ("gptq",
  v1) format; scales [groups, N]; g_idx [K] (act order: the group of each input column).
- AWQ (GEMM version): qweight int32 [K, N / 8] and qzeros [groups, N / 8] with outputs in
  the order 0 2 4 6 1 3 5 7 within a word; scales [groups, N]; zero points as stored.
Act-order weights whose groups sorting makes contiguous again (a whole layer's g_idx) are
stored with their input columns sorted by group, and x is permuted to match (one
index_select a call), so the kernels read one scale and zero per group. Symmetric weights
(every zero 8: compressed-tensors' always, GPTQ's when quantized symmetric) keep no zeros,
and the kernels read none.
CUDA: Triton dequant-GEMM (prefill, kernels/int4_gemm.py) and GEMV (small batches,
kernels/int4_gemv.py); CPU: the reference on a dequantized copy.
"""

from __future__ import annotations

import torch
from torch import nn

from asyncserve.kernels import quant_reference as reference
from asyncserve.kernels.quant_reference import SYMMETRIC_ZERO, pack_int4, unpack_int4
from asyncserve.quantization.base import LinearMethod, set_weight_attrs

# AWQ's order of the eight outputs packed in a word: nibble i holds output AWQ_ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _param(layer: nn.Module, name: str) -> torch.Tensor:
    tensor: torch.Tensor = getattr(layer, name)
    return tensor


def _new(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    out_dim: int = 0,
    rows_per_entry: int = 1,
    in_dim: int = 1,
    cols_per_entry: int = 1,
) -> nn.Parameter:
    """An uninitialised parameter laid out as set_weight_attrs describes."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), False)
    return set_weight_attrs(param, out_dim, rows_per_entry, False, in_dim, cols_per_entry)


class Int4LinearMethod(LinearMethod):
    """Shared by the formats: the converted layout and the matmul."""

    def __init__(self, group_size: int, act_order: bool = False) -> None:
        self.group_size = group_size
        self.act_order = act_order  # a g_idx gives each input column's group

    def groups(self, in_features: int) -> int:
        if in_features % self.group_size or in_features % 8:
            raise ValueError(
                f"a 4-bit layer's {in_features} inputs must be a multiple of the group size "
                f"({self.group_size}) and of 8"
            )
        return in_features // self.group_size

    def check_row_parallel(self, prefix: str, in_features: int, tp_size: int) -> None:
        if not self.act_order:
            self.check_divides(prefix, in_features, tp_size, self.group_size, "group size")
        elif in_features % 8:
            # Act order: a rank's columns draw on any group (all scales are kept, below),
            # but packed weights hold eight columns an entry.
            self.check_divides(prefix, in_features, tp_size, 8, "packing of 8 columns")

    def scale_groups(self, layer: nn.Module, in_features: int) -> tuple[int, int, int]:
        """(groups, in_dim, cols_per_entry) of the layer's [N, groups] scales and zeros: in_dim
        1 (the groups run along dim 1, cols_per_entry inputs each) or -1 (not sliced).
        With act order a group's columns are scattered over the whole input: a row-parallel
        rank keeps every group's scales and zeros, and its slice of g_idx picks them (as
        vLLM does); else a rank holds the groups of its columns."""
        # Of the linear layers only row-parallel ones (models/parallel.py) hold a `tp`.
        tp = getattr(layer, "tp", None)
        ranks = tp.size if tp is not None else 1
        if self.act_order and ranks > 1:
            return self.groups(in_features * ranks), -1, 1
        return self.groups(in_features), 1, self.group_size

    def set_layout(
        self,
        layer: nn.Module,
        values: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        g_idx: torch.Tensor | None,
        drop: tuple[str, ...],
    ) -> None:
        """values [N, K] (0..15), scales / zeros [N, groups]: the layout apply() reads
        (w4_zeros None when every zero is SYMMETRIC_ZERO)."""
        for name in drop:
            delattr(layer, name)
        perm = None
        if g_idx is not None:
            values, g_idx, perm = _contiguous_groups(values, g_idx, self.group_size, scales)
        dtype = scales.dtype
        layer.w4_qweight = nn.Parameter(pack_int4(values).contiguous(), False)
        layer.w4_scales = nn.Parameter(scales.contiguous(), False)
        symmetric = bool((zeros == SYMMETRIC_ZERO).all())
        layer.register_parameter(
            "w4_zeros", None if symmetric else nn.Parameter(zeros.to(dtype).contiguous(), False)
        )
        layer.register_parameter(
            "w4_g_idx", None if g_idx is None else nn.Parameter(g_idx.to(torch.int32), False)
        )
        layer.register_parameter("w4_perm", None if perm is None else nn.Parameter(perm, False))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        qweight, scales, zeros, g_idx = self._weights(layer)
        perm: torch.Tensor | None = getattr(layer, "w4_perm", None)
        if perm is not None:
            x2 = x2.index_select(1, perm)  # the input order of the sorted columns
        if x.is_cuda:
            from asyncserve.kernels.int4_gemm import int4_matmul

            out = int4_matmul(x2, qweight, scales, zeros, g_idx, self.group_size)
        else:
            # The CPU reference multiplies a dequantized copy, made once.
            w: torch.Tensor | None = getattr(layer, "_dequantized", None)
            if w is None:
                w = reference.dequant_int4(qweight, scales, zeros, g_idx, self.group_size)
                layer._dequantized = w
            out = (x2.float() @ w.t()).to(x.dtype)
        if bias is not None:
            out = out + bias
        return out.view(*shape[:-1], out.shape[-1])

    def apply_parts(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        x2 = self._gemv_input(layer, x)
        if x2 is None:
            return None
        from asyncserve.kernels.int4_gemv import int4_gemv

        qweight, scales, zeros, g_idx = self._weights(layer)
        parts = int4_gemv(x2, qweight, scales, zeros, g_idx, self.group_size, keep_splits=True)
        return parts.view(parts.shape[0], *x.shape[:-1], parts.shape[-1])

    def apply_act_and_mul(
        self, layer: nn.Module, x: torch.Tensor, activation: str
    ) -> torch.Tensor | None:
        # A bias would come before the activation.
        x2 = self._gemv_input(layer, x) if layer.bias is None else None
        if x2 is None:
            return None
        from asyncserve.kernels.int4_gemv import int4_gemv

        qweight, scales, zeros, g_idx = self._weights(layer)
        out = int4_gemv(x2, qweight, scales, zeros, g_idx, self.group_size, activation=activation)
        return out.view(*x.shape[:-1], out.shape[-1])

    def _gemv_input(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """x as the GEMV reads it ([M, K], columns in the layer's order), on the GEMV's
        path (CUDA, a decode step's few tokens); None elsewhere."""
        if not x.is_cuda:
            return None  # (nor Triton imported: CPU-only installs may lack it)
        from asyncserve.kernels.split_k import GEMV_MAX_TOKENS

        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] > GEMV_MAX_TOKENS:
            return None
        perm: torch.Tensor | None = getattr(layer, "w4_perm", None)
        if perm is not None:
            x2 = x2.index_select(1, perm)
        return x2 if x2.stride(1) == 1 else x2.contiguous()

    @staticmethod
    def _weights(
        layer: nn.Module,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        g_idx: torch.Tensor | None = getattr(layer, "w4_g_idx", None)
        zeros: torch.Tensor | None = getattr(layer, "w4_zeros", None)
        return _param(layer, "w4_qweight"), _param(layer, "w4_scales"), zeros, g_idx


class PackQuantizedLinearMethod(Int4LinearMethod):
    """compressed-tensors W4A16, symmetric (pack-quantized)."""

    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype
    ) -> None:
        groups, group_dim, group_cols = self.scale_groups(layer, in_features)
        layer.weight_packed = _new((out_features, in_features // 8), torch.int32, 0, 1, 1, 8)
        layer.weight_scale = _new((out_features, groups), dtype, 0, 1, group_dim, group_cols)
        if self.act_order:
            # actorder "group": the group of each input column; q/k/v (gate/up) share it.
            layer.weight_g_idx = _new((in_features,), torch.int32, -1, 1, 0, 1)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        scales = _param(layer, "weight_scale")
        values = unpack_int4(_param(layer, "weight_packed"))
        zeros = torch.full_like(scales, float(SYMMETRIC_ZERO))
        names: tuple[str, ...] = ("weight_packed", "weight_scale")
        g_idx = _param(layer, "weight_g_idx") if self.act_order else None
        if g_idx is not None:
            names += ("weight_g_idx",)
        self.set_layout(layer, values, scales, zeros, g_idx, names)


class GPTQLinearMethod(Int4LinearMethod):
    def __init__(self, group_size: int, desc_act: bool, zeros_minus_one: bool) -> None:
        super().__init__(group_size, act_order=desc_act)
        self.zeros_minus_one = zeros_minus_one

    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype
    ) -> None:
        if out_features % 8:
            raise ValueError(f"a GPTQ layer's outputs ({out_features}) must be a multiple of 8")
        groups, group_dim, group_cols = self.scale_groups(layer, in_features)
        group_dim = 0 if group_dim == 1 else -1  # GPTQ's [groups, N]: the groups along dim 0
        layer.qweight = _new((in_features // 8, out_features), torch.int32, 1, 1, 0, 8)
        layer.qzeros = _new((groups, out_features // 8), torch.int32, 1, 8, group_dim, group_cols)
        layer.scales = _new((groups, out_features), dtype, 1, 1, group_dim, group_cols)
        # One g_idx per layer: q/k/v (gate/up) see the same inputs, so share their order.
        layer.g_idx = _new((in_features,), torch.int32, -1, 1, 0, 1)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        values = unpack_int4(_param(layer, "qweight").t().contiguous())  # [N, K]
        zeros = unpack_int4(_param(layer, "qzeros")).t().float()  # [N, groups]
        if self.zeros_minus_one:
            zeros = zeros + 1
        scales = _param(layer, "scales").t()
        g_idx = _param(layer, "g_idx") if self.act_order else None
        self.set_layout(
            layer, values, scales, zeros, g_idx, ("qweight", "qzeros", "scales", "g_idx")
        )


class AWQLinearMethod(Int4LinearMethod):
    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype
    ) -> None:
        groups = self.groups(in_features)
        if out_features % 8:
            raise ValueError(f"an AWQ layer's outputs ({out_features}) must be a multiple of 8")
        gs = self.group_size
        layer.qweight = _new((in_features, out_features // 8), torch.int32, 1, 8, 0, 1)
        layer.qzeros = _new((groups, out_features // 8), torch.int32, 1, 8, 0, gs)
        layer.scales = _new((groups, out_features), dtype, 1, 1, 0, gs)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        values = _awq_unpack(_param(layer, "qweight")).t()  # [N, K]
        zeros = _awq_unpack(_param(layer, "qzeros")).t().float()  # [N, groups]
        scales = _param(layer, "scales").t()
        self.set_layout(layer, values, scales, zeros, None, ("qweight", "qzeros", "scales"))


def _contiguous_groups(
    values: torch.Tensor, g_idx: torch.Tensor, group_size: int, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Act order made contiguous: the input columns sorted by group, so group g is columns
    g * group_size onward again and the kernels read one scale and zero per group; apply()
    permutes x the same way. Returns (values [N, K] in sorted order, None, the order), or
    the inputs unchanged where sorting leaves groups of other sizes (a row-parallel rank's
    slice of g_idx draws a varying number of columns from each group)."""
    k = g_idx.numel()
    order = torch.argsort(g_idx.long(), stable=True)
    expected = torch.arange(k, device=g_idx.device) // group_size
    if scales.shape[1] * group_size != k or not torch.equal(g_idx.long()[order], expected):
        return values, g_idx, None
    if torch.equal(order, torch.arange(k, device=order.device)):
        return values, None, None  # already in group order
    return values[:, order], None, order


def _awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """[R, C / 8] in AWQ's order -> [R, C] in column order."""
    nibbles = unpack_int4(packed).view(packed.shape[0], -1, 8)  # [..., word, nibble]
    order = torch.tensor(AWQ_ORDER, device=packed.device)
    out = torch.empty_like(nibbles)
    out[..., order] = nibbles
    return out.view(packed.shape[0], -1)
