"""Gemma 3 (text): sliding-window and global layers, sandwich norms, scaled embeddings.

Differences from Llama:
- RMSNorm multiplies by (1 + weight); the loader adds the 1 once, so the shared RMSNorm runs
  as is (dummy weights, filled with 1, are then the identity as well).
- Each layer norms the attention output and the MLP output before they join the residual
  stream (post_attention / post_feedforward norms) besides the usual input norms.
- Sliding layers attend to the last sliding_window positions with their own rotary base
  (rope_local_base_freq, no scaling); global layers use rope_theta and rope_scaling.
- Embeddings are scaled by sqrt(hidden_size) (rounded to the model dtype, as HF does),
  scores by query_pre_attn_scalar ** -0.5, and the final logits soft-capped when the
  config sets final_logit_softcapping (attn_logit_softcapping is ignored, as HF ignores it:
  Gemma 3 has q/k norms instead). The MLP is GELU (tanh) gated.
Tensor parallelism splits it as Llama (models/parallel.py); each rank soft-caps its own
vocabulary slice of the logits (the cap is elementwise).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from asyncserve.kernels.ops import KernelOps
from asyncserve.models.arch_config import ArchConfig
from asyncserve.models.attention import AttentionMetadata
from asyncserve.models.base import CausalLM
from asyncserve.models.layers import (
    GatedMLP,
    LMHead,
    RMSNorm,
    RotaryEmbedding,
    VocabEmbedding,
    compute_logits,
)
from asyncserve.models.llama import LlamaAttention, fused_target
from asyncserve.models.moe import ExpertPlacement
from asyncserve.models.parallel import SINGLE, TensorParallel, VocabParallelEmbedding
from asyncserve.models.weights import Target, load_checkpoint


class Gemma3DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ArchConfig,
        layer: int,
        rotary: RotaryEmbedding,
        ops: KernelOps,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = LlamaAttention(config, layer, rotary, ops, tp)
        self.mlp = GatedMLP(hidden, config.intermediate_size, ops, config.hidden_act, tp)
        self.input_layernorm = RMSNorm(hidden, eps, ops)
        self.post_attention_layernorm = RMSNorm(hidden, eps, ops)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, ops)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, ops)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # As in Llama, each branch's output leaves un-added; the next norm adds it.
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        hidden = self.post_attention_layernorm(hidden)
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        hidden = self.mlp(hidden)
        return self.post_feedforward_layernorm(hidden), residual


class Gemma3Model(nn.Module):
    def __init__(self, config: ArchConfig, ops: KernelOps, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.embed_tokens: VocabEmbedding | VocabParallelEmbedding
        if tp.size == 1:
            self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        else:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        max_pos = config.max_position_embeddings
        global_rotary = RotaryEmbedding(
            config.rotary_dim, max_pos, config.rope_theta, config.rope_scaling, ops
        )
        local_theta = config.rope_local_theta or config.rope_theta
        local_rotary = RotaryEmbedding(config.rotary_dim, max_pos, local_theta, None, ops)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(
                config, i, local_rotary if config.is_sliding(i) else global_rotary, ops, tp
            )
            for i in range(config.num_hidden_layers)
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
        hidden = hidden * torch.tensor(self.hidden_size**0.5, dtype=hidden.dtype)
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        if residual is None:
            return self.norm(hidden)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Gemma3ForCausalLM(CausalLM):
    def __init__(
        self,
        config: ArchConfig,
        ops: KernelOps,
        placement: ExpertPlacement | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        del placement  # dense model
        self.config = config
        self.tp = tp
        self.model = Gemma3Model(config, ops, tp)
        self.lm_head: LMHead | VocabEmbedding | VocabParallelEmbedding
        if config.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = LMHead(config.vocab_size // tp.size, config.hidden_size)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        self.check_caches(kv_caches)
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last(self.local_logits(hidden))

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # The soft cap is elementwise: each rank caps its own vocabulary slice.
        logits = compute_logits(hidden, self.lm_head.weight)
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_checkpoint(self, weights, self.route)

    def route(self, hf_name: str) -> Target | None:
        # Checkpoints of the multimodal model nest the text model one level deeper.
        hf_name = hf_name.replace("model.language_model.", "model.", 1)
        target = fused_target(self.config, hf_name, self.tp)
        if target is not None and target.name.endswith("norm.weight"):
            return Target(target.name, offset=1.0)
        return target

    def checkpoint_slice(self, hf_name: str) -> tuple[int, int, int] | None:
        target = self.route(hf_name)
        return target.source if target is not None else None

    def checkpoint_skips(self, hf_name: str) -> bool:
        return self.route(hf_name) is None
