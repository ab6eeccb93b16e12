"""Llama-family decoder: Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm).

Parameter names follow HF's with q/k/v fused into `qkv_proj` and gate/up into `gate_up_proj`;
load_weights takes HF checkpoint names and fills the fused slices.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from asyncserve.kernels.ops import KernelOps
from asyncserve.models.arch_config import ArchConfig
from asyncserve.models.attention import Attention, AttentionMetadata
from asyncserve.models.layers import (
    GatedMLP,
    Linear,
    LMHead,
    RMSNorm,
    RotaryEmbedding,
    VocabEmbedding,
    compute_logits,
)

# HF name fragment -> (fused parameter fragment, shard index within the fused rows).
_FUSED_SHARDS: dict[str, tuple[str, int]] = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class LlamaAttention(nn.Module):
    def __init__(self, config: ArchConfig, rotary: RotaryEmbedding, ops: KernelOps) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops)
        # Shared by every layer: one cos/sin table per model, not per layer.
        self.rotary_emb = rotary
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, ops
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            # Qwen3 normalises each head's query and key before rotary.
            q = self.q_norm(q.reshape(-1, self.head_dim))
            k = self.k_norm(k.reshape(-1, self.head_dim))
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ArchConfig, rotary: RotaryEmbedding, ops: KernelOps) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary, ops)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, ops)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual add is fused into the next norm, so hidden leaves un-added.
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ArchConfig, ops: KernelOps) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            ops,
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, rotary, ops) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        if residual is None:
            return self.norm(hidden)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ArchConfig, ops: KernelOps) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, ops)
        # A tied head is the embedding module itself, so the tie survives .to() and to_empty().
        self.lm_head: LMHead | VocabEmbedding
        if config.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = LMHead(config.vocab_size, config.hidden_size)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions [T] int64 -> final-normed hidden states [T, hidden]."""
        if len(kv_caches) != self.config.num_hidden_layers:
            raise ValueError(
                f"kv_caches must hold one (key, value) pair per layer "
                f"({self.config.num_hidden_layers}), got {len(kv_caches)}"
            )
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32."""
        return compute_logits(hidden, self.lm_head.weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into this model's (fused) parameters, converting dtype and
        device on the way. Returns the parameter names filled; raises ValueError on an unknown
        name, a shape mismatch, or a parameter left without a value."""
        params = dict(self.named_parameters())
        filled: set[str] = set()
        fused_parts: dict[str, set[int]] = {}
        for hf_name, tensor in weights:
            if "rotary_emb.inv_freq" in hf_name:
                continue  # recomputed from the config
            if hf_name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # some tied checkpoints still carry a copy
            name, shard = _fused_target(hf_name)
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in the model")
            target = param.data if shard is None else self._shard(param.data, name, shard)
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(target.shape)}"
                )
            target.copy_(tensor)
            if shard is None:
                filled.add(name)
            else:
                fused_parts.setdefault(name, set()).add(shard)
        for name, shards in fused_parts.items():
            if len(shards) == (3 if ".qkv_proj." in name else 2):
                filled.add(name)
        missing = sorted(set(params) - filled)
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} weights: {shown}")
        return filled

    def _shard(self, data: torch.Tensor, name: str, shard: int) -> torch.Tensor:
        """The rows of a fused parameter that one HF tensor fills."""
        if ".qkv_proj." in name:
            sizes = [self.config.q_size, self.config.kv_size, self.config.kv_size]
        else:
            sizes = [self.config.intermediate_size] * 2
        start = sum(sizes[:shard])
        return data[start : start + sizes[shard]]


def _fused_target(hf_name: str) -> tuple[str, int | None]:
    for fragment, (fused, shard) in _FUSED_SHARDS.items():
        if fragment in hf_name:
            return hf_name.replace(fragment, fused), shard
    return hf_name, None
