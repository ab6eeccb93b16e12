"""M-RoPE (Qwen2-VL / Qwen2.5-VL): rotary positions with three rows, temporal / height / width.

Text tokens sit at one position on all three rows, as in plain RoPE. The tokens of an image
get (start, start + row, start + column) over its grid of merged patches, and the text after
it resumes at start + max(rows, columns). The head's rotary frequencies are split into
`mrope_section` parts (summing to head_dim / 2): the first part turns by the temporal row, the
second by the height row, the third by the width row.

Tokens after the prompt continue at their index + `delta` (the prompt's last position + 1
minus its length) on all three rows, where M-RoPE equals plain RoPE at that position.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from asyncserve.kernels.ops import KernelOps
from asyncserve.models.layers import RotaryEmbedding


def mrope_positions(
    num_tokens: int,
    images: Sequence[tuple[int, tuple[int, int, int]]],
    merge_size: int,
) -> tuple[torch.Tensor, int]:
    """The prompt's [3, num_tokens] int64 positions and the delta of the tokens after it.

    images: (offset, grid_thw in patches) of each image's placeholder run, in prompt order;
    a run holds t * h * w / merge_size^2 tokens (transformers' get_rope_index).
    """
    rows: list[torch.Tensor] = []
    at = 0  # next token index
    pos = 0  # next text position
    for offset, (t, h, w) in images:
        gh, gw = h // merge_size, w // merge_size
        if offset < at or offset + t * gh * gw > num_tokens:
            raise ValueError(
                f"image placeholder run at {offset} (grid {t}x{h}x{w}) does not fit the "
                f"prompt of {num_tokens} tokens after position {at}"
            )
        rows.append(torch.arange(pos, pos + offset - at).expand(3, -1))
        pos += offset - at
        grid = torch.stack(
            torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
        )
        rows.append(grid.reshape(3, -1) + pos)
        pos += max(gh, gw)
        at = offset + t * gh * gw
    rows.append(torch.arange(pos, pos + num_tokens - at).expand(3, -1))
    positions = torch.cat(rows, dim=1)
    delta = (int(positions.max()) + 1 if num_tokens else 0) - num_tokens
    return positions, delta


class MRotaryEmbedding(RotaryEmbedding):
    """NeoX rotary over positions [T] (plain) or [3, T] (M-RoPE). For [3, T] each token's
    cos/sin row is gathered section by section from its three positions, and the same
    rotary op runs on that per-token table."""

    section_row: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        rope_scaling: dict[str, Any] | None,
        ops: KernelOps,
        mrope_section: Sequence[int],
    ) -> None:
        super().__init__(head_dim, max_position, base, rope_scaling, ops)
        if sum(mrope_section) != head_dim // 2 or len(mrope_section) != 3:
            raise ValueError(
                f"mrope_section {list(mrope_section)} must have 3 parts summing to "
                f"head_dim / 2 = {head_dim // 2}"
            )
        # Which position row turns each frequency; the cos and sin halves alike.
        half = torch.cat([torch.full((n,), i) for i, n in enumerate(mrope_section)])
        section_row = torch.cat((half, half)).to(self.cos_sin_cache.device)
        self.register_buffer("section_row", section_row, persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.ndim == 1:
            return super().forward(positions, query, key)
        # [3, T, rotary_dim] -> [T, rotary_dim]: column j from row section_row[j].
        per_row = self.cos_sin_cache[positions.long()]
        index = self.section_row.view(1, 1, -1).expand(1, per_row.shape[1], -1)
        table = per_row.gather(0, index).squeeze(0)
        token = torch.arange(positions.shape[1], device=positions.device)
        return self.ops.rotary_embedding(token, query, key, table)
