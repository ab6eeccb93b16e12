"""GGUF Q8_0, Q4_K and Q4_1 linear weights kept quantized (`quantization="gguf"`).

The loader copies each kept tensor's raw GGUF blocks (uint8 [N, K / block, block_bytes]) into
the layer's `weight`, fused projections row by row as usual; a tensor-parallel rank reads
whole rows of a column-parallel layer and whole blocks of a row-parallel one (its inputs in
blocks along dim 1). A row-parallel layer whose per-rank inputs are not a whole number of
blocks is dequantized at load instead (logged). Once loaded, the blocks are
repacked into the layout of kernels/quant_reference.py (dequant_gguf), which holds the same
numbers without the byte-level interleaving (fp16 scales as their own tensors, nibbles in
column order), so the kernel reads aligned tensors:
- Q8_0: blocks of 32: fp16 d, 32 int8. 8.5 bits per weight, unchanged.
- Q4_1: blocks of 32: fp16 d, fp16 m, 16 bytes of nibbles (low: 0..15, high: 16..31);
  w = d * q + m. 5 bits, unchanged.
- Q4_K: super-blocks of 256: fp16 d, fp16 dmin, 12 bytes holding eight 6-bit (scale, min)
  pairs, 128 bytes of nibbles (each 32 bytes: low nibbles one sub-block, high the next);
  w = d * sc * q - dmin * m. 4.5 bits in the file, 4.625 repacked (the 6-bit pairs as bytes).
CUDA: a dequantizing Triton GEMM (kernels/gguf_gemm.py); CPU: the reference on a dequantized
copy, made once. Other tensor types (Q6_K, F16, ...) and embeddings are dequantized at load.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from gguf import GGMLQuantizationType as T
from torch import nn

from asyncserve.kernels import quant_reference as reference
from asyncserve.kernels.quant_reference import pack_int4
from asyncserve.quantization.base import LinearMethod, QuantConfig, set_weight_attrs

logger = logging.getLogger(__name__)

# Kept types: (elements per block, bytes per block).
BLOCKS = {T.Q8_0: (32, 34), T.Q4_1: (32, 20), T.Q4_K: (256, 144)}
_FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def _halves(raw: torch.Tensor, start: int) -> torch.Tensor:
    """fp16 values at byte `start` of each block: raw [N, blocks, bytes] -> [N, blocks]."""
    return raw[..., start : start + 2].contiguous().view(torch.float16).squeeze(-1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_1's 16 bytes per block [..., 16] -> 32 values: low nibbles first, then high."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's get_scale_min_k4 over 12-byte groups [..., 12] -> (sc, m) each [..., 8]."""
    lo_sc, lo_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    hi_sc = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    hi_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return torch.cat([lo_sc, hi_sc], dim=-1), torch.cat([lo_m, hi_m], dim=-1)


@dataclass
class GGUFLayout:
    """The repacked tensors of one layer (see kernels/quant_reference.dequant_gguf)."""

    qweight: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor | None
    sub_scale: torch.Tensor | None
    sub_min: torch.Tensor | None
    super_block: int


def repack(raw: torch.Tensor, qtype: T, in_features: int) -> GGUFLayout:
    """Raw GGUF blocks uint8 [N, K / block, block bytes] (or [N, row bytes]) of type `qtype`
    -> the repacked layout."""
    block, nbytes = BLOCKS[qtype]
    n = raw.shape[0]
    blocks = raw.view(n, in_features // block, nbytes)
    if qtype == T.Q8_0:
        qs = blocks[..., 2:].contiguous().view(torch.int8).reshape(n, in_features)
        return GGUFLayout(qs, _halves(blocks, 0), None, None, None, block)
    if qtype == T.Q4_1:
        values = _nibbles(blocks[..., 4:]).reshape(n, in_features)
        minimum = -_halves(blocks, 2)  # w = d * q - (-m): exact, and one kernel form
        return GGUFLayout(pack_int4(values), _halves(blocks, 0), minimum, None, None, block)
    # Q4_K: each 32 bytes of qs hold two sub-blocks (low nibbles, then high).
    qs = blocks[..., 16:].reshape(n, -1, 4, 32)
    values = torch.stack([qs & 0xF, qs >> 4], dim=3).reshape(n, in_features)
    sc, m = _k_scale_min(blocks[..., 4:16])
    return GGUFLayout(
        pack_int4(values),
        _halves(blocks, 0),
        _halves(blocks, 2),
        sc.reshape(n, -1).contiguous(),
        m.reshape(n, -1).contiguous(),
        block,
    )


_NAMES = ("gguf_qweight", "gguf_scale", "gguf_min", "gguf_sub_scale", "gguf_sub_min")


class GGUFLinearMethod(LinearMethod):
    def __init__(self, qtype: T) -> None:
        self.qtype = qtype
        self.super_block = BLOCKS[qtype][0]

    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype
    ) -> None:
        block, nbytes = BLOCKS[self.qtype]
        if in_features % block:
            raise ValueError(f"a {self.qtype.name} layer's inputs must be a multiple of {block}")
        shape = (out_features, in_features // block, nbytes)
        weight = nn.Parameter(torch.empty(shape, dtype=torch.uint8), False)
        # One entry along dim 1 is one block of `block` input columns.
        layer.weight = set_weight_attrs(weight, in_dim=1, cols_per_entry=block)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight: torch.Tensor = getattr(layer, "weight")  # noqa: B009 (typed as Module else)
        in_features: int = getattr(layer, "in_features")  # noqa: B009
        layout = repack(weight.data, self.qtype, in_features)
        del layer.weight
        for name, tensor in zip(_NAMES, self._tensors(layout), strict=True):
            param = None if tensor is None else nn.Parameter(tensor.contiguous(), False)
            layer.register_parameter(name, param)

    @staticmethod
    def _tensors(layout: GGUFLayout) -> tuple[torch.Tensor | None, ...]:
        return (layout.qweight, layout.scale, layout.minimum, layout.sub_scale, layout.sub_min)

    def layout(self, layer: nn.Module) -> GGUFLayout:
        qweight, scale, minimum, sub_scale, sub_min = (getattr(layer, n) for n in _NAMES)
        return GGUFLayout(qweight, scale, minimum, sub_scale, sub_min, self.super_block)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        lay = self.layout(layer)
        tensors = (lay.qweight, lay.scale, lay.minimum, lay.sub_scale, lay.sub_min)
        if x.is_cuda:
            from asyncserve.kernels.gguf_gemm import gguf_matmul

            out = gguf_matmul(x2, *tensors, lay.super_block)
        else:
            # The CPU reference multiplies a dequantized copy, made once.
            w: torch.Tensor | None = getattr(layer, "_dequantized", None)
            if w is None:
                w = reference.dequant_gguf(*tensors, lay.super_block)
                layer._dequantized = w
            out = (x2.float() @ w.t()).to(x.dtype)
        if bias is not None:
            out = out + bias
        return out.view(*shape[:-1], out.shape[-1])


@dataclass
class GGUFConfig(QuantConfig):
    """Built from the file: `types` maps each linear tensor's HF module name to its GGML
    type. A layer is kept quantized when all its parts (q/k/v, gate/up) share a kept type;
    `kept` collects the HF weight names the loader then hands over raw."""

    types: dict[str, T]
    kept: set[str] = field(default_factory=set)
    name: str = "gguf"

    def linear_method(
        self, prefix: str, in_features: int, out_features: int
    ) -> LinearMethod | None:
        head, _, last = prefix.rpartition(".")
        parts = [prefix]
        if prefix not in self.types and last in _FUSED:
            parts = [f"{head}.{p}" for p in _FUSED[last]]
        found = {self.types.get(p) for p in parts}
        if len(found) != 1:
            return None
        (qtype,) = found
        if qtype not in BLOCKS:
            return None
        if in_features % BLOCKS[qtype][0]:
            # A row-parallel rank's share of the inputs would cut the blocks.
            logger.info(
                "%s: %d input columns are not whole %s blocks of %d: dequantized at load",
                prefix, in_features, qtype.name, BLOCKS[qtype][0],
            )  # fmt: skip
            return None
        self.kept.update(f"{p}.weight" for p in parts)
        return GGUFLinearMethod(qtype)

    def keeps_raw(self, hf_name: str) -> bool:
        return hf_name in self.kept
