"""CLIP and SigLIP vision transformers (the vision towers of LLaVA checkpoints).

Parameter names follow transformers' CLIPVisionModel / SiglipVisionModel under their
`vision_model.` prefix (embeddings, pre_layrnorm, encoder.layers.N, post_layernorm).
`forward` returns the hidden states the caller selects (`vision_feature_layer`), computing
only the layers up to the deepest one asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncserve.models.layers import LayerNorm, Linear


def activation(name: str) -> Any:
    """HF activation names used by vision towers and projectors."""
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    if name == "gelu":
        return F.gelu
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "silu":
        return F.silu
    raise ValueError(f"activation {name!r} is not supported in a vision tower or projector")


@dataclass(frozen=True)
class VisionArch:
    kind: str  # "clip" or "siglip"
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> VisionArch:
        model_type = str(d.get("model_type") or "clip_vision_model")
        if model_type in ("clip_vision_model", "clip"):
            kind, defaults = "clip", (768, 3072, 12, 12, 224, 32, "quick_gelu")
        elif model_type in ("siglip_vision_model", "siglip"):
            kind, defaults = "siglip", (768, 3072, 12, 12, 224, 16, "gelu_pytorch_tanh")
        else:
            raise ValueError(
                f"vision tower {model_type!r} is not supported (supported: CLIP, SigLIP)"
            )
        hidden, inter, layers, heads, size, patch, act = defaults
        arch = cls(
            kind=kind,
            hidden_size=int(d.get("hidden_size", hidden)),
            intermediate_size=int(d.get("intermediate_size", inter)),
            num_hidden_layers=int(d.get("num_hidden_layers", layers)),
            num_attention_heads=int(d.get("num_attention_heads", heads)),
            image_size=int(d.get("image_size", size)),
            patch_size=int(d.get("patch_size", patch)),
            num_channels=int(d.get("num_channels", 3)),
            layer_norm_eps=float(d.get("layer_norm_eps", 1e-6 if kind == "siglip" else 1e-5)),
            hidden_act=str(d.get("hidden_act", act)),
        )
        if arch.hidden_size % arch.num_attention_heads:
            raise ValueError("vision hidden_size must be a multiple of num_attention_heads")
        activation(arch.hidden_act)
        return arch

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_positions(self) -> int:
        """Tokens the tower outputs per image: the patches, and CLIP's class token."""
        return self.num_patches + (1 if self.kind == "clip" else 0)


class VisionEmbeddings(nn.Module):
    def __init__(self, arch: VisionArch) -> None:
        super().__init__()
        self.has_class = arch.kind == "clip"
        if self.has_class:
            self.class_embedding = nn.Parameter(torch.empty(arch.hidden_size), requires_grad=False)
        self.patch_embedding = nn.Conv2d(
            arch.num_channels,
            arch.hidden_size,
            kernel_size=arch.patch_size,
            stride=arch.patch_size,
            bias=arch.kind == "siglip",
        )
        self.patch_embedding.requires_grad_(False)
        self.position_embedding = nn.Embedding(arch.num_positions, arch.hidden_size)
        self.position_embedding.requires_grad_(False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype))  # [B, D, h, w]
        x = patches.flatten(2).transpose(1, 2)
        if self.has_class:
            cls = self.class_embedding.expand(x.shape[0], 1, -1)
            x = torch.cat([cls, x], dim=1)
        return x + self.position_embedding.weight.unsqueeze(0)


class VisionAttention(nn.Module):
    def __init__(self, arch: VisionArch) -> None:
        super().__init__()
        d = arch.hidden_size
        self.num_heads = arch.num_attention_heads
        self.q_proj = Linear(d, d, bias=True)
        self.k_proj = Linear(d, d, bias=True)
        self.v_proj = Linear(d, d, bias=True)
        self.out_proj = Linear(d, d, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        shape = (b, s, self.num_heads, d // self.num_heads)
        q, k, v = (
            p(x).view(shape).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v)  # every patch sees every patch
        return self.out_proj(out.transpose(1, 2).reshape(b, s, d))


class VisionMLP(nn.Module):
    def __init__(self, arch: VisionArch) -> None:
        super().__init__()
        self.act = activation(arch.hidden_act)
        self.fc1 = Linear(arch.hidden_size, arch.intermediate_size, bias=True)
        self.fc2 = Linear(arch.intermediate_size, arch.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionLayer(nn.Module):
    def __init__(self, arch: VisionArch) -> None:
        super().__init__()
        self.layer_norm1 = LayerNorm(arch.hidden_size, arch.layer_norm_eps)
        self.self_attn = VisionAttention(arch)
        self.layer_norm2 = LayerNorm(arch.hidden_size, arch.layer_norm_eps)
        self.mlp = VisionMLP(arch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, arch: VisionArch) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(arch) for _ in range(arch.num_hidden_layers))


class VisionTransformer(nn.Module):
    """pixel_values [B, C, H, W] -> the hidden states named by `layers` (HF's
    output_hidden_states indexing: 0 is the embeddings, -1 the last layer's output)."""

    def __init__(self, arch: VisionArch) -> None:
        super().__init__()
        self.arch = arch
        self.embeddings = VisionEmbeddings(arch)
        # CLIP normalises the embeddings first (HF's spelling of the name kept).
        self.pre_layrnorm: LayerNorm | None = None
        if arch.kind == "clip":
            self.pre_layrnorm = LayerNorm(arch.hidden_size, arch.layer_norm_eps)
        self.encoder = VisionEncoder(arch)
        self.post_layernorm = LayerNorm(arch.hidden_size, arch.layer_norm_eps)

    def hidden_state_index(self, layer: int) -> int:
        n = self.arch.num_hidden_layers + 1
        index = layer + n if layer < 0 else layer
        if not 0 <= index < n:
            raise ValueError(f"vision_feature_layer {layer} is out of range for {n - 1} layers")
        return index

    def forward(self, pixel_values: torch.Tensor, layers: list[int]) -> list[torch.Tensor]:
        wanted = [self.hidden_state_index(layer) for layer in layers]
        x = self.embeddings(pixel_values)
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        states = [x]
        for layer in self.encoder.layers[: max(wanted)]:
            x = layer(x)
            states.append(x)
        return [states[i] for i in wanted]
