"""EAGLE-1 head for a Llama-family target, in the published checkpoint layout.

The head takes, at position p, the embedding of token p + 1 and the target's last hidden
state at p, joins them through `fc` (2 * hidden -> hidden) and runs one Llama decoder
layer; its output is the predicted hidden state at p + 1, read through the target's
lm_head (no final norm) and fed back as the next position's hidden state. As in EAGLE and
vLLM's EagleLlamaForCausalLM, the target hidden state is its model output (after the final
norm) and the first layer has no input norm. The embedding and lm_head are the target's:
a copy of embed_tokens in the checkpoint is not read.

Checkpoint: config.json like the target's (num_hidden_layers 1) and safetensors with
`fc.weight` (optionally `fc.bias`) and `layers.0.*` (HF names, also under `model.`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from asyncserve.kernels.ops import select_ops
from asyncserve.models.arch_config import ArchConfig
from asyncserve.models.attention import AttentionMetadata
from asyncserve.models.layers import GatedMLP, RotaryEmbedding
from asyncserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM, fused_target
from asyncserve.models.weights import Target, load_checkpoint

# Tensors of a published head that the engine takes from the target instead.
_SHARED = ("embed_tokens.", "lm_head.", "norm.")


class EagleHead(nn.Module):
    def __init__(self, arch: ArchConfig, fc_bias: bool, device: torch.device) -> None:
        super().__init__()
        if arch.num_hidden_layers != 1:
            raise ValueError(
                "speculative_config: an EAGLE head has one decoder layer, got "
                f"num_hidden_layers {arch.num_hidden_layers}"
            )
        ops = select_ops(device)
        self.arch = arch
        hidden = arch.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=fc_bias)
        rotary = RotaryEmbedding(
            arch.rotary_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling, ops
        )
        mlp = GatedMLP(hidden, arch.intermediate_size, ops)
        layer = LlamaDecoderLayer(arch, 0, rotary, ops, mlp)
        # EAGLE's first layer reads fc's output as it is.
        layer.input_layernorm = nn.Identity()  # type: ignore[assignment]
        self.layers = nn.ModuleList([layer])

    def target_states(self, target: LlamaForCausalLM, hidden: torch.Tensor) -> torch.Tensor:
        """The head's input hidden states for a target forward: its output."""
        return hidden

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token embeddings and hidden states [T, H] at `positions` -> the next hidden
        state [T, H], twice: read through the target's lm_head and fed back."""
        x = self.fc(torch.cat([embeds, hidden.to(embeds.dtype)], dim=-1))
        x, residual = self.layers[0](positions, x, None, kv_caches[0], meta)
        out = x + residual
        return out, out

    def route(self, hf_name: str) -> Target | None:
        name = hf_name.removeprefix("model.")
        if name.startswith(_SHARED) or name == "layers.0.input_layernorm.weight":
            return None
        return fused_target(self.arch, name)


def read_head_config(path: str, what: str) -> dict[str, Any]:
    """A head directory's config.json as a dict; a one-line ValueError naming the file."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"speculative_config: {what} {path!r} has no config.json")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"speculative_config: cannot read {config_file}: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"speculative_config: {config_file} must hold a JSON object")
    return config


def load_eagle_head(
    path: str, target_arch: ArchConfig, dtype: torch.dtype, device: torch.device
) -> EagleHead:
    """The head in `path` (a directory), checked against the target it speculates for."""
    root = Path(path)
    own_config = read_head_config(path, "EAGLE head")
    if any("Eagle3" in str(name) for name in own_config.get("architectures") or ()):
        raise ValueError(f"speculative_config: {path!r} is an EAGLE-3 head: use method 'eagle3'")
    # Heads name their own class (EagleLlamaForCausalLM) or the target's: a Llama layer.
    hf_config = {**own_config, "architectures": ["LlamaForCausalLM"]}
    arch = ArchConfig.from_hf_dict(hf_config)
    for key in ("hidden_size", "vocab_size"):
        own, target = getattr(arch, key), getattr(target_arch, key)
        if own != target:
            raise ValueError(
                f"speculative_config: the EAGLE head's {key} ({own}) differs from the "
                f"target's ({target})"
            )
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"speculative_config: EAGLE head {path!r} has no .safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    fc_bias = any(name.removeprefix("model.") == "fc.bias" for name in tensors)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            head = EagleHead(arch, fc_bias, device)
    finally:
        torch.set_default_dtype(previous)
    load_checkpoint(head, tensors.items(), head.route)
    return head.eval()
