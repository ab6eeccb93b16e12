"""Per-tensor KV cache scales stored in FP8 checkpoints, for `--kv-cache-dtype fp8`.

Names as the producers write them: compressed-tensors (llmcompressor's kv_cache_scheme)
`<layer>.self_attn.k_scale` / `.v_scale`; AutoFP8 `<layer>.self_attn.k_proj.output_scale` /
`.v_proj.output_scale`; older checkpoints one `<layer>.self_attn.kv_scale` for both. Without
them the scales are 1.0 (as in vLLM): e4m3 then covers values up to 448.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from asyncserve.models.attention import Attention

_SUFFIXES = {
    ".k_scale": ("k",),
    ".v_scale": ("v",),
    ".k_proj.output_scale": ("k",),
    ".v_proj.output_scale": ("v",),
    ".kv_scale": ("k", "v"),
}


class KVScales:
    """Takes the KV scale tensors out of a checkpoint's stream, then sets them on the model."""

    def __init__(self) -> None:
        self.scales: dict[tuple[str, str], float] = {}

    def filter(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            for suffix, kinds in _SUFFIXES.items():
                if name.endswith(suffix) and tensor.numel() == 1:
                    attn = name[: -len(suffix)]
                    for kind in kinds:
                        self.scales[(attn, kind)] = float(tensor.float().item())
                    break
            else:
                yield name, tensor

    def apply(self, model: nn.Module) -> int:
        """Set each layer's scales (on its `<self_attn>.attn` Attention); returns how many."""
        modules = dict(model.named_modules())
        for (attn, kind), value in self.scales.items():
            layer = modules.get(attn + ".attn")
            if not isinstance(layer, Attention):
                raise ValueError(f"checkpoint KV scale of {attn!r} has no attention layer")
            if not value > 0:
                raise ValueError(f"checkpoint KV scale of {attn!r} must be > 0, got {value}")
            setattr(layer, f"{kind}_scale", value)
        return len(self.scales)
