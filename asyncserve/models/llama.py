"""Llama-family decoder: Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm);
also the base of the families that differ from it only in config values or in their MLP
(Granite, Phi-3, Mixtral, Qwen3-MoE).

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
from asyncserve.models.base import CausalLM
from asyncserve.models.layers import (
    GatedMLP,
    Linear,
    LMHead,
    RMSNorm,
    RotaryEmbedding,
    VocabEmbedding,
    compute_logits,
    linear_parts,
)
from asyncserve.models.moe import ExpertPlacement
from asyncserve.models.mrope import MRotaryEmbedding
from asyncserve.models.parallel import (
    SINGLE,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
)
from asyncserve.models.pipeline import MissingLayer, PipelineStage
from asyncserve.models.split_sums import SplitSums, dense
from asyncserve.models.weights import Target, load_checkpoint

# HF name fragment -> (fused parameter fragment, shard index within the fused rows).
_FUSED_SHARDS: dict[str, tuple[str, int]] = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: ArchConfig,
        layer: int,
        rotary: RotaryEmbedding,
        ops: KernelOps,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        # This rank's heads (all of them without tensor parallelism).
        self.num_heads = config.num_attention_heads // tp.size
        self.num_kv_heads = tp.kv_heads(config.num_key_value_heads)[1]
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj: Linear | RowParallelLinear
        if tp.size == 1:
            self.o_proj = Linear(self.q_size, config.hidden_size)
        else:
            self.o_proj = RowParallelLinear(config.q_size, config.hidden_size, tp)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops)
        # Shared by every layer: one cos/sin table per model, not per layer.
        self.rotary_emb = rotary
        self.ops = ops
        self.qk_norm_eps = config.rms_norm_eps
        # Plain NeoX rotary (not M-RoPE's position rows) runs fused with the KV store.
        self.fuse_rope_store = type(rotary) is RotaryEmbedding
        scale = config.attention_scale or self.head_dim**-0.5
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            scale,
            ops,
            sliding_window=config.layer_window(layer),
        )
        # Set where a fused add-norm takes o_proj's output (models/split_sums.py); then the
        # rope-store kernel also adds qkv_proj's split sums.
        self.split_output = False

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor | SplitSums:
        sizes = [self.q_size, self.kv_size, self.kv_size]
        if self.fuse_rope_store and self.split_output:
            # The projection's split-K partial sums, where it leaves them, are added by the
            # rope-store kernel (models/split_sums.py).
            qkv = linear_parts(self.qkv_proj, hidden)
        else:
            qkv = self.qkv_proj(hidden)
        dtype = None
        if isinstance(qkv, SplitSums):
            q, k, v = qkv.parts.split(sizes, dim=-1)  # [parts, tokens, size] each
            dtype = qkv.dtype
        else:
            q, k, v = qkv.split(sizes, dim=-1)
        # Views of the fused projection's rows: no copies (the per-head norms read them too).
        q = q.unflatten(-1, (self.num_heads, self.head_dim))
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.fuse_rope_store:
            # One kernel: the per-head norms (Qwen3, Gemma 3), rotary and the KV store.
            attn = self.attn
            q = self.ops.rope_store_kv(
                positions,
                q,
                k,
                v,
                self.rotary_emb.cos_sin_cache,
                None if self.q_norm is None else self.q_norm.weight,
                None if self.k_norm is None else self.k_norm.weight,
                self.qk_norm_eps,
                *kv_cache,
                meta.slot_mapping,
                attn.k_scale,
                attn.v_scale,
                dtype=dtype,
            )
            return self._project(attn.attend(q, kv_cache, meta))
        if self.q_norm is not None and self.k_norm is not None:
            # Qwen3 and Gemma 3 normalise each head's query and key before rotary.
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self._project(self.attn(q, k, v, kv_cache, meta))

    def _project(self, attn_out: torch.Tensor) -> torch.Tensor | SplitSums:
        if self.split_output:
            return linear_parts(self.o_proj, attn_out)
        out: torch.Tensor = self.o_proj(attn_out)
        return out


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ArchConfig,
        layer: int,
        rotary: RotaryEmbedding,
        ops: KernelOps,
        mlp: nn.Module,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer, rotary, ops, tp)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        # Granite scales each branch before it joins the residual stream.
        self.residual_multiplier = config.residual_multiplier

    def leave_split_sums(self) -> None:
        """o_proj's and a gated MLP's down_proj's split-K partial sums go to the next fused
        add-norm unsummed (models/split_sums.py): this layer's post-attention norm and the
        next layer's input norm (or the model's final norm); qkv_proj's to the rope-store
        kernel. Not under a branch multiplier, which scales the sums first."""
        if self.residual_multiplier == 1.0:
            self.self_attn.split_output = True
            if isinstance(self.mlp, GatedMLP):
                self.mlp.split_output = True

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor | SplitSums,
        residual: torch.Tensor | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor | SplitSums, torch.Tensor]:
        # The residual add is fused into the next norm, so hidden leaves un-added.
        if residual is None:
            residual = dense(hidden)
            hidden = self.input_layernorm(residual)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        out = self.self_attn(positions, hidden, kv_cache, meta)
        if self.residual_multiplier != 1.0:  # no split sums then (leave_split_sums)
            out = dense(out) * self.residual_multiplier
        hidden, residual = self.post_attention_layernorm(out, residual)
        out = self.mlp(hidden)
        if self.residual_multiplier != 1.0:
            out = dense(out) * self.residual_multiplier
        return out, residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: ArchConfig,
        ops: KernelOps,
        mlps: list[nn.Module | None],
        tp: TensorParallel = SINGLE,
        pp: PipelineStage | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens: VocabEmbedding | VocabParallelEmbedding
        if tp.size == 1:
            self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        else:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.embedding_multiplier = config.embedding_multiplier
        rotary_args = (
            config.rotary_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            ops,
        )
        # The Qwen2-VL family's positions may come as [3, T] rows (M-RoPE).
        rotary = (
            MRotaryEmbedding(*rotary_args, config.mrope_section)
            if config.mrope_section
            else RotaryEmbedding(*rotary_args)
        )
        # A pipeline stage builds only its layers; the others hold no parameters.
        self.layers = nn.ModuleList(
            MissingLayer() if mlp is None else LlamaDecoderLayer(config, i, rotary, ops, mlp, tp)
            for i, mlp in enumerate(mlps)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.pp = pp
        start, end = (0, len(mlps)) if pp is None else (pp.start, pp.end)
        self.local_layers = [self.layers[i] for i in range(start, end)]
        # EAGLE-3: the residual stream entering these layers (vLLM's layer ids: 0 is the
        # embedding output) is kept in `aux_hidden_states` by each forward, in layer order.
        # Empty unless an EAGLE-3 head is configured.
        self.aux_hidden_state_layers: frozenset[int] = frozenset()
        self.aux_hidden_states: list[torch.Tensor] = []
        for layer in self.local_layers:
            if isinstance(layer, LlamaDecoderLayer):
                layer.leave_split_sums()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`inputs_embeds` [T, hidden], when given, replace the token embeddings (a
        multimodal model's image rows written over its placeholders)."""
        pp = self.pp
        residual: torch.Tensor | None = None
        if inputs_embeds is not None:
            hidden = inputs_embeds
        elif pp is None or pp.is_first:
            hidden = self.embed_tokens(input_ids)
            if self.embedding_multiplier != 1.0:
                hidden = hidden * self.embedding_multiplier
        else:
            like = self.norm.weight.new_empty(input_ids.shape[0], self.norm.weight.shape[0])
            hidden, residual = pp.recv(like)
        # The KV caches are this stage's layers' only.
        if self.aux_hidden_state_layers:
            hidden, residual = self._forward_capturing(positions, hidden, residual, kv_caches, meta)
        else:
            for layer, kv_cache in zip(self.local_layers, kv_caches, strict=True):
                hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        if pp is not None and not pp.is_last:
            assert residual is not None
            pp.send(dense(hidden), residual)
            return hidden  # not final: only the last stage's output is read
        if residual is None:
            return self.norm(hidden)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def _forward_capturing(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer loop, keeping the residual stream entering the auxiliary layers (one
        stage only: an EAGLE-3 head needs pipeline_parallel_size 1)."""
        captured: list[torch.Tensor] = []
        for i, (layer, kv_cache) in enumerate(zip(self.local_layers, kv_caches, strict=True)):
            if i in self.aux_hidden_state_layers:
                captured.append(dense(hidden) if residual is None else dense(hidden) + residual)
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        self.aux_hidden_states = captured
        return hidden, residual


class LlamaForCausalLM(CausalLM):
    """Subclasses change the MLP of a layer (make_mlp) and where checkpoint tensors go
    (route); everything else follows the config."""

    def __init__(
        self,
        config: ArchConfig,
        ops: KernelOps,
        placement: ExpertPlacement | None = None,
        tp: TensorParallel = SINGLE,
        pp: PipelineStage | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.placement = placement
        # Set before make_mlp, which reads it.
        self.tp = tp
        self.pp = pp
        mlps: list[nn.Module | None] = [
            self.make_mlp(config, ops, i) if pp is None or pp.holds(i) else None
            for i in range(config.num_hidden_layers)
        ]
        self.model = LlamaModel(config, ops, mlps, tp, pp)
        # A tied head is the embedding module itself, so the tie survives .to() and to_empty().
        self.lm_head: LMHead | VocabEmbedding | VocabParallelEmbedding
        if config.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            # With tensor parallelism, this rank's slice of the vocabulary.
            self.lm_head = LMHead(config.vocab_size // tp.size, config.hidden_size)

    def make_mlp(self, config: ArchConfig, ops: KernelOps, layer: int) -> nn.Module:
        return GatedMLP(config.hidden_size, config.intermediate_size, ops, tp=self.tp)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions [T] int64 -> final-normed hidden states [T, hidden]."""
        if self.pp is None:
            self.check_caches(kv_caches)
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32, on every rank."""
        return self.tp.all_gather_last(self.local_logits(hidden))

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, this rank's vocabulary slice] float32."""
        logits = compute_logits(hidden, self.lm_head.weight)
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into this model's (fused) parameters, converting dtype and
        device on the way. Returns the parameter names filled; raises ValueError on an unknown
        name, a shape mismatch, or a parameter left without a value."""
        return load_checkpoint(self, weights, self.route)

    def route(self, hf_name: str) -> Target | None:
        """Where one HF checkpoint tensor goes; None to skip it."""
        if self.pp is not None and not self.pp.holds_tensor(hf_name):
            return None  # another pipeline stage's layer
        return fused_target(self.config, hf_name, self.tp)

    def checkpoint_slice(self, hf_name: str) -> tuple[int, int, int] | None:
        target = self.route(hf_name)
        return target.source if target is not None else None

    def checkpoint_skips(self, hf_name: str) -> bool:
        return self.route(hf_name) is None


def fused_target(config: ArchConfig, hf_name: str, tp: TensorParallel = SINGLE) -> Target | None:
    """Target of an HF tensor in a model that fuses q/k/v and gate/up; None to skip it.
    With tensor parallelism the target also names the slice of the tensor this rank holds."""
    if "rotary_emb.inv_freq" in hf_name:
        return None  # recomputed from the config
    if hf_name == "lm_head.weight" and config.tie_word_embeddings:
        return None  # some tied checkpoints still carry a copy
    q_start, q_size = tp.split(config.q_size)
    ffn_start, ffn_size = tp.split(config.intermediate_size)
    for fragment, (fused, shard) in _FUSED_SHARDS.items():
        if fragment in hf_name:
            if fused == ".qkv_proj.":
                first_kv, num_kv = tp.kv_heads(config.num_key_value_heads)
                kv_size = num_kv * config.head_dim
                sizes = [q_size, kv_size, kv_size]
                starts = [q_start, first_kv * config.head_dim, first_kv * config.head_dim]
            else:
                sizes = [ffn_size] * 2
                starts = [ffn_start] * 2
            rows = (sum(sizes[:shard]), sizes[shard])
            source = (0, starts[shard], sizes[shard]) if tp.size > 1 else None
            return Target(hf_name.replace(fragment, fused), rows=rows, source=source)
    if tp.size == 1:
        return Target(hf_name)
    if ".o_proj." in hf_name:
        return Target(hf_name, source=(1, q_start, q_size))
    if ".down_proj." in hf_name:
        return Target(hf_name, source=(1, ffn_start, ffn_size))
    if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
        return Target(hf_name, source=(0, *tp.split(config.vocab_size)))
    return Target(hf_name)
