"""Qwen3-MoE: Qwen3 (per-head q/k RMSNorm) with sparse MoE MLPs.

A layer is sparse unless listed in mlp_only_layers, and only every decoder_sparse_step-th
layer is; dense layers keep Qwen3's gated MLP (intermediate_size), experts have
moe_intermediate_size. norm_topk_prob says whether the top-k weights are renormalised.
Checkpoint names: mlp.gate (router), mlp.experts.{e}.gate_proj / up_proj / down_proj.
"""

from __future__ import annotations

import re

from torch import nn

from asyncserve.kernels.ops import KernelOps
from asyncserve.models.arch_config import ArchConfig
from asyncserve.models.llama import LlamaForCausalLM
from asyncserve.models.moe import SparseMoE, expert_target
from asyncserve.models.weights import Target

_EXPERT = re.compile(
    r"^(model\.layers\.(\d+)\.mlp)\.experts\.(\d+)\.(gate|up|down)_proj\."
    r"(weight|weight_scale|weight_scale_inv)$"
)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    def make_mlp(self, config: ArchConfig, ops: KernelOps, layer: int) -> nn.Module:
        assert config.moe is not None
        if config.moe.is_sparse(layer):
            return SparseMoE(config.hidden_size, config.moe, ops, self.placement, tp=self.tp)
        return super().make_mlp(config, ops, layer)

    def route(self, hf_name: str) -> Target | None:
        match = _EXPERT.match(hf_name)
        if match:
            prefix, layer, expert, proj, suffix = match.groups()
            moe = self.model.layers[int(layer)].mlp
            return expert_target(moe, prefix, proj, int(expert), suffix)
        # The router is mlp.gate, as named in the model; dense layers route as Qwen3's.
        return super().route(hf_name)
