"""Mixtral: the Llama decoder with a sparse MoE MLP in every layer (softmax top-k routing,
weights renormalised over the chosen experts).

Checkpoint names: block_sparse_moe.gate (router) and block_sparse_moe.experts.{e}.w1 / w3 /
w2 (gate / up / down of expert e).
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
    r"^(model\.layers\.(\d+))\.block_sparse_moe\.experts\.(\d+)\.(w[123])\."
    r"(weight|weight_scale|weight_scale_inv)$"
)
_ROUTER = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.gate\.weight$")
_PROJ = {"w1": "gate", "w3": "up", "w2": "down"}


class MixtralForCausalLM(LlamaForCausalLM):
    def make_mlp(self, config: ArchConfig, ops: KernelOps, layer: int) -> nn.Module:
        assert config.moe is not None
        return SparseMoE(config.hidden_size, config.moe, ops, self.placement, tp=self.tp)

    def route(self, hf_name: str) -> Target | None:
        match = _EXPERT.match(hf_name)
        if match:
            prefix, layer, expert, proj, suffix = match.groups()
            moe = self.model.layers[int(layer)].mlp
            return expert_target(moe, f"{prefix}.mlp", _PROJ[proj], int(expert), suffix)
        match = _ROUTER.match(hf_name)
        if match:
            return Target(f"{match.group(1)}.mlp.gate.weight")
        return super().route(hf_name)
