"""EAGLE-3 head for a Llama-family target, in the published checkpoint layout (the one
vLLM's Eagle3LlamaForCausalLM reads).

The target keeps the residual stream entering three of its layers (low, middle, high;
`eagle_aux_hidden_state_layer_ids` in the head's config, else vLLM's default 2,
L // 2, L - 3), concatenated in layer order; `fc` (3 * target hidden -> hidden) turns
them into the head's input hidden state. Head position p takes the embedding of token
p + 1 and that hidden state at p. Its one decoder layer (`midlayer`) normalises both
(`input_layernorm` on the embedding, `hidden_norm` on the hidden state) and attends over
their concatenation (q/k/v are 2 * hidden wide); the hidden state is the residual. The
output goes through `norm` to the head's own `lm_head` over a draft vocabulary of
`draft_vocab_size` tokens, whose ids map to the target's by `d2t` (target id = draft id
+ d2t[draft id]). The pre-norm output is fed back as the next position's hidden state,
without `fc`. The embedding is the target's unless the checkpoint carries its own.

Checkpoint: config.json (`architectures: ["LlamaForCausalLMEagle3"]`, one layer,
`draft_vocab_size`, optionally `target_hidden_size` and `norm_before_residual`) and
safetensors (or pytorch_model.bin) with `fc.weight`, `midlayer.*` (or `layers.0.*`),
`norm.weight`, `lm_head.weight`, `d2t` and optionally `t2d` (unused) and `embed_tokens`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from asyncserve.kernels.ops import KernelOps, select_ops
from asyncserve.models.arch_config import ArchConfig
from asyncserve.models.attention import AttentionMetadata
from asyncserve.models.layers import (
    GatedMLP,
    Linear,
    LMHead,
    RMSNorm,
    RotaryEmbedding,
    VocabEmbedding,
    compute_logits,
)
from asyncserve.models.llama import LlamaAttention, LlamaForCausalLM, fused_target
from asyncserve.models.weights import Target, load_checkpoint
from asyncserve.spec_decode.eagle_head import read_head_config

AUX_LAYERS_KEY = "eagle_aux_hidden_state_layer_ids"
_ERR = "speculative_config: EAGLE-3 head"


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's default: an early, a middle and a late layer of the target."""
    return (2, num_layers // 2, num_layers - 3)


class Eagle3MidLayer(nn.Module):
    def __init__(
        self, arch: ArchConfig, rotary: RotaryEmbedding, ops: KernelOps, norm_before_residual: bool
    ) -> None:
        super().__init__()
        hidden, eps = arch.hidden_size, arch.rms_norm_eps
        self.self_attn = LlamaAttention(arch, 0, rotary, ops)
        attn = self.self_attn
        # Attention reads [normed embedding | normed hidden state].
        attn.qkv_proj = Linear(2 * hidden, attn.q_size + 2 * attn.kv_size, arch.attention_bias)
        self.mlp = GatedMLP(hidden, arch.intermediate_size, ops)
        self.input_layernorm = RMSNorm(hidden, eps, ops)
        self.hidden_norm = RMSNorm(hidden, eps, ops)
        self.post_attention_layernorm = RMSNorm(hidden, eps, ops)
        self.norm_before_residual = norm_before_residual

    def forward(
        self,
        positions: torch.Tensor,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = hidden
        hidden = self.hidden_norm(hidden)
        if self.norm_before_residual:
            residual = hidden
        x = torch.cat([self.input_layernorm(embeds), hidden], dim=-1)
        x = self.self_attn(positions, x, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Eagle3Head(nn.Module):
    def __init__(
        self,
        arch: ArchConfig,
        aux_layers: tuple[int, ...],
        target_hidden: int,
        draft_vocab_size: int,
        own_embedding: bool,
        norm_before_residual: bool,
        device: torch.device,
    ) -> None:
        super().__init__()
        ops = select_ops(device)
        self.arch = arch
        self.aux_layers = aux_layers
        hidden = arch.hidden_size
        self.fc = Linear(len(aux_layers) * target_hidden, hidden)
        rotary = RotaryEmbedding(
            arch.rotary_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling, ops
        )
        self.midlayer = Eagle3MidLayer(arch, rotary, ops, norm_before_residual)
        self.norm = RMSNorm(hidden, arch.rms_norm_eps, ops)
        self.lm_head = LMHead(draft_vocab_size, hidden)
        self.embed_tokens = VocabEmbedding(arch.vocab_size, hidden) if own_embedding else None
        # Target id of each draft id; None when the draft vocabulary is the target's.
        self.draft_to_target: torch.Tensor | None = None

    def target_states(self, target: LlamaForCausalLM, hidden: torch.Tensor) -> torch.Tensor:
        """The head's input hidden states [T, H] for the target forward that just ran."""
        del hidden  # the final hidden states are EAGLE-1's input, not this head's
        aux, target.model.aux_hidden_states = target.model.aux_hidden_states, []
        return self.fc(torch.cat(aux, dim=-1))

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (normed output for the logits, pre-norm output fed back), each [T, H]."""
        x, residual = self.midlayer(positions, embeds, hidden.to(embeds.dtype), kv_caches[0], meta)
        return self.norm(x, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, target vocab] float32; tokens outside the draft vocabulary -inf."""
        logits = compute_logits(hidden, self.lm_head.weight)
        if self.draft_to_target is None:
            return logits
        full = logits.new_full((logits.shape[0], self.arch.vocab_size), float("-inf"))
        full[:, self.draft_to_target] = logits
        return full

    def route(self, name: str) -> Target | None:
        if name.startswith("midlayer."):
            return fused_target(self.arch, name)
        return Target(name)


def load_eagle3_head(
    path: str, target_arch: ArchConfig, dtype: torch.dtype, device: torch.device
) -> Eagle3Head:
    """The head in `path` (a directory), checked against the target it speculates for."""
    root = Path(path)
    config = read_head_config(path, "EAGLE-3 head")
    # The head's layer is a Llama layer; its rotary table covers the target's positions.
    max_pos = max(
        int(config.get("max_position_embeddings", 2048)), target_arch.max_position_embeddings
    )
    arch = ArchConfig.from_hf_dict(
        {**config, "architectures": ["LlamaForCausalLM"], "max_position_embeddings": max_pos}
    )
    if arch.num_hidden_layers != 1:
        raise ValueError(
            f"{_ERR} has one decoder layer, got num_hidden_layers {arch.num_hidden_layers}"
        )
    if arch.vocab_size != target_arch.vocab_size:
        raise ValueError(
            f"{_ERR}'s vocab_size ({arch.vocab_size}) differs from the target's "
            f"({target_arch.vocab_size})"
        )
    target_hidden = int(config.get("target_hidden_size") or arch.hidden_size)
    if target_hidden != target_arch.hidden_size:
        raise ValueError(
            f"{_ERR}'s target_hidden_size ({target_hidden}) differs from the "
            f"target's hidden_size ({target_arch.hidden_size})"
        )
    eagle_config = config.get("eagle_config") or {}
    if eagle_config.get("use_aux_hidden_state", True) is False:
        raise ValueError(f"{_ERR}s without auxiliary hidden states are not supported")
    tensors = _read_tensors(root, path)
    if not any(name.startswith("midlayer.") for name in tensors):
        raise ValueError(
            f"{_ERR} {path!r} has no midlayer.* tensors (for an EAGLE-1 head, use method 'eagle')"
        )
    aux_layers = _aux_layers(config, eagle_config, target_arch.num_hidden_layers)
    fc = tensors.get("fc.weight")
    if fc is None or fc.dim() != 2 or fc.shape[1] != len(aux_layers) * target_hidden:
        shape = None if fc is None else tuple(fc.shape)
        raise ValueError(
            f"{_ERR}'s fc.weight has shape {shape}; the target layers {list(aux_layers)} "
            f"give {len(aux_layers) * target_hidden} inputs (set {AUX_LAYERS_KEY} in "
            "its config.json to the layers it was trained on)"
        )
    draft_vocab = int(config.get("draft_vocab_size") or arch.vocab_size)
    d2t = tensors.pop("d2t", None)
    tensors.pop("t2d", None)
    own_embedding = "embed_tokens.weight" in tensors
    if not own_embedding and arch.hidden_size != target_arch.hidden_size:
        raise ValueError(
            f"{_ERR} has no embed_tokens.weight and its hidden_size "
            f"({arch.hidden_size}) differs from the target's "
            f"({target_arch.hidden_size})"
        )
    draft_to_target = _draft_to_target(d2t, draft_vocab, arch.vocab_size)
    norm_before_residual = bool(config.get("norm_before_residual", False))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            head = Eagle3Head(
                arch,
                aux_layers,
                target_hidden,
                draft_vocab,
                own_embedding,
                norm_before_residual,
                device,
            )
    finally:
        torch.set_default_dtype(previous)
    if draft_to_target is not None:
        head.draft_to_target = draft_to_target.to(device)
    try:
        load_checkpoint(head, tensors.items(), head.route)
    except ValueError as exc:
        raise ValueError(f"{_ERR} {path!r}: {exc}") from None
    return head.eval()


def _read_tensors(root: Path, path: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors by name, `layers.0.` read as `midlayer.` and a `model.`
    prefix dropped."""
    raw: dict[str, torch.Tensor] = {}
    files = sorted(root.glob("*.safetensors"))
    if files:
        for file in files:
            raw.update(load_file(str(file)))
    elif (root / "pytorch_model.bin").is_file():
        raw = torch.load(root / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"{_ERR} {path!r} has no .safetensors files or pytorch_model.bin")
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in raw.items():
        name = name.removeprefix("model.")
        if name.startswith("layers.0."):
            name = "midlayer." + name.removeprefix("layers.0.")
        if "rotary_emb.inv_freq" not in name:
            tensors[name] = tensor
    return tensors


def _aux_layers(
    config: dict[str, Any], eagle_config: dict[str, Any], num_layers: int
) -> tuple[int, ...]:
    """The target layers whose input the head reads, in layer order (as vLLM concatenates
    them: a layer named twice is read once)."""
    ids = config.get(AUX_LAYERS_KEY) or eagle_config.get(AUX_LAYERS_KEY)
    if ids is None:
        ids = default_aux_layers(num_layers)
    elif not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in ids
    ):
        raise ValueError(f"{_ERR}: {AUX_LAYERS_KEY} must be a list of integers, got {ids!r}")
    layers = tuple(sorted(set(ids)))
    if layers[0] < 0 or layers[-1] >= num_layers:
        raise ValueError(
            f"{_ERR}: target layers {list(ids)} are not all in [0, {num_layers}) "
            f"(the target has {num_layers} layers)"
        )
    return layers


def _draft_to_target(d2t: torch.Tensor | None, draft_vocab: int, vocab: int) -> torch.Tensor | None:
    if not 1 <= draft_vocab <= vocab:
        raise ValueError(f"{_ERR}'s draft_vocab_size ({draft_vocab}) must be in [1, {vocab}]")
    if d2t is None:
        if draft_vocab != vocab:
            raise ValueError(
                f"{_ERR}'s draft_vocab_size ({draft_vocab}) differs from "
                f"vocab_size ({vocab}) but it has no d2t tensor"
            )
        return None
    if tuple(d2t.shape) != (draft_vocab,) or d2t.is_floating_point():
        raise ValueError(
            f"{_ERR}'s d2t must be integer with shape ({draft_vocab},), got "
            f"{d2t.dtype} {tuple(d2t.shape)}"
        )
    targets = torch.arange(draft_vocab, dtype=torch.int64) + d2t.to(torch.int64)
    if int(targets.min()) < 0 or int(targets.max()) >= vocab:
        raise ValueError(f"{_ERR}'s d2t maps draft ids outside the target vocabulary [0, {vocab})")
    return targets
