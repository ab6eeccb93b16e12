"""OPT: learned absolute positions, LayerNorm, ReLU MLP, biases everywhere.

Positions index a learned table with an offset of 2 (the first two rows are reserved, as in
fairseq). do_layer_norm_before selects pre-norm layers (most sizes, with a final norm) or
post-norm ones (opt-350m, without one). When word_embed_proj_dim differs from the hidden
size, embeddings are projected in (project_in) and the last hidden states out (project_out).
Checkpoints name the decoder `model.decoder.*` or, in the original uploads, `decoder.*`.
Tensor parallelism: column-parallel q/k/v and fc1 (with their biases), row-parallel
out_proj and fc2 (whole bias added after the all-reduce), vocab-parallel embedding and head;
positions and project_in / project_out are replicated.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from asyncserve.kernels.ops import KernelOps
from asyncserve.models.arch_config import ArchConfig
from asyncserve.models.attention import Attention, AttentionMetadata
from asyncserve.models.base import CausalLM
from asyncserve.models.layers import LayerNorm, Linear, LMHead, VocabEmbedding, compute_logits
from asyncserve.models.moe import ExpertPlacement
from asyncserve.models.parallel import (
    SINGLE,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
)
from asyncserve.models.weights import Target, load_checkpoint

_POSITION_OFFSET = 2
_LAYER_NORM_EPS = 1e-5  # HF's OPT uses nn.LayerNorm's default
_QKV = {".q_proj.": 0, ".k_proj.": 1, ".v_proj.": 2}


def _row_linear(in_features: int, out_features: int, tp: TensorParallel) -> nn.Module:
    if tp.size == 1:
        return Linear(in_features, out_features, bias=True)
    return RowParallelLinear(in_features, out_features, tp, bias=True)


class OPTAttention(nn.Module):
    def __init__(self, config: ArchConfig, ops: KernelOps, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads // tp.size
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        self.qkv_proj = Linear(hidden, 3 * hidden // tp.size, bias=True)
        self.out_proj = _row_linear(hidden, hidden, tp)
        self.attn = Attention(
            self.num_heads, self.num_heads, self.head_dim, self.head_dim**-0.5, ops
        )

    def forward(
        self,
        hidden: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        shape = (hidden.shape[0], self.num_heads, self.head_dim)
        q, k, v = (t.reshape(shape) for t in self.qkv_proj(hidden).chunk(3, dim=-1))
        return self.out_proj(self.attn(q, k, v, kv_cache, meta))


class OPTDecoderLayer(nn.Module):
    def __init__(self, config: ArchConfig, ops: KernelOps, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.pre_norm = config.do_layer_norm_before
        self.self_attn = OPTAttention(config, ops, tp)
        self.self_attn_layer_norm = LayerNorm(hidden, _LAYER_NORM_EPS)
        self.fc1 = Linear(hidden, config.intermediate_size // tp.size, bias=True)
        self.fc2 = _row_linear(config.intermediate_size, hidden, tp)
        self.final_layer_norm = LayerNorm(hidden, _LAYER_NORM_EPS)

    def forward(
        self,
        hidden: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        residual = hidden
        if self.pre_norm:
            hidden = self.self_attn_layer_norm(hidden)
        hidden = residual + self.self_attn(hidden, kv_cache, meta)
        if not self.pre_norm:
            hidden = self.self_attn_layer_norm(hidden)
        residual = hidden
        if self.pre_norm:
            hidden = self.final_layer_norm(hidden)
        hidden = residual + self.fc2(F.relu(self.fc1(hidden)))
        if not self.pre_norm:
            hidden = self.final_layer_norm(hidden)
        return hidden


class OPTDecoder(nn.Module):
    def __init__(self, config: ArchConfig, ops: KernelOps, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        hidden = config.hidden_size
        embed_dim = config.word_embed_proj_dim or hidden
        self.embed_tokens: VocabEmbedding | VocabParallelEmbedding
        if tp.size == 1:
            self.embed_tokens = VocabEmbedding(config.vocab_size, embed_dim)
        else:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, embed_dim, tp)
        self.embed_positions = VocabEmbedding(
            config.max_position_embeddings + _POSITION_OFFSET, hidden
        )
        self.project_in: Linear | None = None
        self.project_out: Linear | None = None
        if embed_dim != hidden:
            self.project_in = Linear(embed_dim, hidden)
            self.project_out = Linear(hidden, embed_dim)
        self.layers = nn.ModuleList(
            OPTDecoderLayer(config, ops, tp) for _ in range(config.num_hidden_layers)
        )
        self.final_layer_norm: LayerNorm | None = None
        if config.do_layer_norm_before:
            self.final_layer_norm = LayerNorm(hidden, _LAYER_NORM_EPS)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.project_in is not None:
            hidden = self.project_in(hidden)
        hidden = hidden + self.embed_positions(positions + _POSITION_OFFSET)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, kv_cache, meta)
        if self.final_layer_norm is not None:
            hidden = self.final_layer_norm(hidden)
        if self.project_out is not None:
            hidden = self.project_out(hidden)
        return hidden


class OPTModel(nn.Module):
    def __init__(self, config: ArchConfig, ops: KernelOps, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.decoder = OPTDecoder(config, ops, tp)


class OPTForCausalLM(CausalLM):
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
        self.model = OPTModel(config, ops, tp)
        embed = self.model.decoder.embed_tokens
        self.lm_head: LMHead | VocabEmbedding | VocabParallelEmbedding
        if config.tie_word_embeddings:
            self.lm_head = embed
        else:
            self.lm_head = LMHead(config.vocab_size // tp.size, embed.weight.shape[1])

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        self.check_caches(kv_caches)
        return self.model.decoder(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last(self.local_logits(hidden))

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return compute_logits(hidden, self.lm_head.weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_checkpoint(self, weights, self.route)

    def route(self, hf_name: str) -> Target | None:
        if hf_name.startswith("decoder."):
            hf_name = "model." + hf_name
        if hf_name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None
        tp = self.tp
        for fragment, shard in _QKV.items():
            if fragment in hf_name:
                start, size = tp.split(self.config.hidden_size)
                source = (0, start, size) if tp.size > 1 else None
                name = hf_name.replace(fragment, ".qkv_proj.")
                return Target(name, rows=(shard * size, size), source=source)
        if tp.size == 1:
            return Target(hf_name)
        ffn = tp.split(self.config.intermediate_size)
        if ".fc1." in hf_name:
            return Target(hf_name, source=(0, *ffn))
        if hf_name.endswith((".fc2.weight", ".out_proj.weight")):
            columns = ffn if ".fc2." in hf_name else tp.split(self.config.hidden_size)
            return Target(hf_name, source=(1, *columns))
        if hf_name in ("model.decoder.embed_tokens.weight", "lm_head.weight"):
            return Target(hf_name, source=(0, *tp.split(self.config.vocab_size)))
        return Target(hf_name)

    def checkpoint_slice(self, hf_name: str) -> tuple[int, int, int] | None:
        target = self.route(hf_name)
        return target.source if target is not None else None

    def checkpoint_skips(self, hf_name: str) -> bool:
        return self.route(hf_name) is None
