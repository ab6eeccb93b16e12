"""Qwen2.5-VL vision transformer: flattened patches of images -> LM-width image embeddings.

Layout as HF's `Qwen2_5_VisionTransformerPretrainedModel` (parameter names kept, so the
checkpoint's `visual.*` tensors load one to one): a patch embedding (a Conv3d whose stride is
its kernel, i.e. a linear map of each flattened patch), 2D rotary positions (height and width
halves of each head), blocks of pre-norm attention + SwiGLU MLP where most blocks attend
within windows of merged patches and `fullatt_block_indexes` blocks attend over the whole
image, and a merger that folds each 2x2 group of patches into one LM token.

Windowed attention runs as HF's: patches are permuted so each window is contiguous, the
blocks attend within segments of cu_seqlens, and the merger's output is permuted back.
Segments of equal length run as one batched attention call (SDPA: flash / memory-efficient
kernels on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncserve.kernels.ops import KernelOps
from asyncserve.models.layers import Linear, RMSNorm

VISION_EPS = 1e-6  # HF hard-codes the vision norms' epsilon


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    window_size: int
    fullatt_block_indexes: tuple[int, ...]
    in_channels: int = 3
    rope_theta: float = 10000.0
    hidden_act: str = "silu"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values in one flattened patch: channels x temporal x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> VisionConfig:
        rope = d.get("rope_parameters") or {}
        config = cls(
            depth=int(d["depth"]),
            hidden_size=int(d["hidden_size"]),
            num_heads=int(d["num_heads"]),
            intermediate_size=int(d["intermediate_size"]),
            out_hidden_size=int(d["out_hidden_size"]),
            patch_size=int(d.get("patch_size", 14)),
            temporal_patch_size=int(d.get("temporal_patch_size", 2)),
            spatial_merge_size=int(d.get("spatial_merge_size", 2)),
            window_size=int(d.get("window_size", 112)),
            fullatt_block_indexes=tuple(int(i) for i in d.get("fullatt_block_indexes", ())),
            in_channels=int(d.get("in_channels", 3)),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            hidden_act=str(d.get("hidden_act", "silu")),
        )
        if config.hidden_size % config.num_heads or config.head_dim % 4:
            raise ValueError(
                f"vision hidden_size {config.hidden_size} / num_heads {config.num_heads} "
                "must give a head_dim divisible by 4 (2D rotary)"
            )
        if config.hidden_act != "silu":
            raise ValueError(f"vision hidden_act {config.hidden_act!r} is not supported (silu)")
        return config


def window_index(
    grid_thw: list[tuple[int, int, int]], config: VisionConfig
) -> tuple[torch.Tensor, list[int]]:
    """The permutation of merged-patch groups that makes each attention window contiguous,
    and the windows' cumulative patch counts (HF's get_vision_window_index)."""
    merge = config.spatial_merge_size
    unit = merge * merge
    win = config.window_size // merge // config.patch_size  # window side in merged patches
    indices: list[torch.Tensor] = []
    cu = [0]
    first = 0
    for t, h, w in grid_thw:
        gh, gw = h // merge, w // merge
        index = torch.arange(t * gh * gw).reshape(t, gh, gw)
        pad_h, pad_w = -gh % win, -gw % win
        nh, nw = (gh + pad_h) // win, (gw + pad_w) // win
        padded = F.pad(index, (0, pad_w, 0, pad_h), value=-1)
        padded = padded.reshape(t, nh, win, nw, win).permute(0, 1, 3, 2, 4)
        padded = padded.reshape(t, nh * nw, win * win)
        lengths = (padded >= 0).sum(-1).reshape(-1)
        flat = padded.reshape(-1)
        indices.append(flat[flat >= 0] + first)
        for length in lengths.tolist():
            if length:  # a window wholly in the padding is no segment
                cu.append(cu[-1] + length * unit)
        first += t * gh * gw
    return torch.cat(indices), cu


def rotary_table(grid_thw: list[tuple[int, int, int]], config: VisionConfig) -> torch.Tensor:
    """[patches, head_dim]: cos then sin of each patch's (row, column) angles, patches in the
    processor's order (merge groups contiguous)."""
    merge = config.spatial_merge_size
    quarter = config.head_dim // 2
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter)
    )
    rows = []
    for t, h, w in grid_thw:
        hpos, wpos = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        hpos = hpos.reshape(shape).transpose(1, 2).flatten()
        wpos = wpos.reshape(shape).transpose(1, 2).flatten()
        rows.append(torch.stack([hpos, wpos], dim=-1).repeat(t, 1))
    pos = torch.cat(rows).float()  # [patches, 2]
    freqs = (pos[..., None] * inv_freq).flatten(1)  # [patches, head_dim / 2]: h then w
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def segment_groups(cu_seqlens: list[int], device: torch.device) -> list[torch.Tensor]:
    """The segments of cu_seqlens grouped by length: one [segments, length] row index per
    length (most windows are full, so there are few groups). Built once per forward."""
    by_length: dict[int, list[int]] = {}
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True):
        by_length.setdefault(end - start, []).append(start)
    return [
        (torch.tensor(starts)[:, None] + torch.arange(length)).to(device)
        for length, starts in by_length.items()
    ]


def segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: list[torch.Tensor], scale: float
) -> torch.Tensor:
    """Bidirectional attention within each segment. q, k, v [T, H, D] -> [T, H, D]; groups
    from segment_groups, each run as one batched attention call."""
    out = torch.empty_like(q)
    for index in groups:
        qs, ks, vs = (x[index].transpose(1, 2) for x in (q, k, v))  # [B, H, L, D]
        o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)
        out[index] = o.transpose(1, 2)
    return out


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig, ops: KernelOps) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.ops = ops
        self.qkv = Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.proj = Linear(config.hidden_size, config.hidden_size, bias=True)

    def forward(
        self, x: torch.Tensor, rotary: torch.Tensor, groups: list[torch.Tensor]
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, self.head_dim).unbind(1)
        positions = torch.arange(n, device=x.device)
        q, k = self.ops.rotary_embedding(positions, q.contiguous(), k.contiguous(), rotary)
        out = segment_attention(q, k, v, groups, self.head_dim**-0.5)
        return self.proj(out.reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig, ops: KernelOps) -> None:
        super().__init__()
        self.norm1 = RMSNorm(config.hidden_size, VISION_EPS, ops)
        self.norm2 = RMSNorm(config.hidden_size, VISION_EPS, ops)
        self.attn = VisionAttention(config, ops)
        self.mlp = VisionMLP(config)

    def forward(
        self, x: torch.Tensor, rotary: torch.Tensor, groups: list[torch.Tensor]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rotary, groups)
        return x + self.mlp(self.norm2(x))


class ConvWeight(nn.Module):
    """Holds a conv weight under the checkpoint's name (`proj.weight`)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape), requires_grad=False)


class PatchEmbed(nn.Module):
    """HF's Conv3d with stride == kernel: one linear map per flattened patch. The weight keeps
    the checkpoint's conv shape [hidden, C, T, P, P]."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        c = config
        self.hidden_size = c.hidden_size
        shape = (c.hidden_size, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size)
        self.proj = ConvWeight(shape)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight.reshape(self.hidden_size, -1)
        return F.linear(patches.to(weight.dtype), weight)


class PatchMerger(nn.Module):
    """RMSNorm each patch, concatenate each merge group (merge^2 patches), 2-layer GELU MLP."""

    def __init__(self, config: VisionConfig, ops: KernelOps) -> None:
        super().__init__()
        self.width = config.hidden_size * config.spatial_merge_size**2
        self.ln_q = RMSNorm(config.hidden_size, VISION_EPS, ops)
        # Indices 0 and 2 as in HF's nn.Sequential(Linear, GELU, Linear).
        self.mlp = nn.ModuleList(
            [
                Linear(self.width, self.width, bias=True),
                nn.GELU(),
                Linear(self.width, config.out_hidden_size, bias=True),
            ]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_q(x).reshape(-1, self.width)
        for layer in self.mlp:
            x = layer(x)
        return x


class Qwen2_5_VisionTransformer(nn.Module):
    def __init__(self, config: VisionConfig, ops: KernelOps) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.blocks = nn.ModuleList(VisionBlock(config, ops) for _ in range(config.depth))
        self.merger = PatchMerger(config, ops)
        self.full_attention = set(config.fullatt_block_indexes)

    def num_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        """LM tokens of one image: its patches over the merge group size."""
        t, h, w = grid_thw
        return t * h * w // self.config.spatial_merge_size**2

    def forward(
        self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]
    ) -> torch.Tensor:
        """pixel_values [patches, patch_dim] of one or more images (the processor's layout,
        images one after another) -> [sum of num_tokens, out_hidden_size]."""
        c = self.config
        expected = sum(t * h * w for t, h, w in grid_thw)
        if pixel_values.shape != (expected, c.patch_dim):
            raise ValueError(
                f"pixel_values has shape {tuple(pixel_values.shape)}, expected "
                f"({expected}, {c.patch_dim}) for image grids {grid_thw}"
            )
        unit = c.spatial_merge_size**2
        order, cu_windows = window_index(grid_thw, c)
        order = order.to(pixel_values.device)
        cu_full = [0]
        for t, h, w in grid_thw:
            for _ in range(t):  # each frame attends over itself
                cu_full.append(cu_full[-1] + h * w)

        def permute(x: torch.Tensor) -> torch.Tensor:
            return x.reshape(-1, unit, x.shape[-1])[order].reshape(-1, x.shape[-1])

        hidden = permute(self.patch_embed(pixel_values))
        rotary = permute(rotary_table(grid_thw, c).to(hidden.device))
        full = segment_groups(cu_full, hidden.device)
        windows = segment_groups(cu_windows, hidden.device)
        for i, block in enumerate(self.blocks):
            hidden = block(hidden, rotary, full if i in self.full_attention else windows)
        merged = self.merger(hidden)
        return merged[torch.argsort(order)]
