"""Granite and GraniteMoE (PowerMoE): the Llama decoder with four multipliers, which the
shared Llama layers apply from the config: embeddings x embedding_multiplier, each residual
branch x residual_multiplier, attention_multiplier as the softmax scale, logits /
logits_scaling. GraniteMoE replaces every MLP with a sparse MoE whose experts the checkpoint
stacks: block_sparse_moe.input_linear [E, 2I, H] (gate rows, then up rows),
block_sparse_moe.output_linear [E, H, I] and the router block_sparse_moe.router.layer.
"""

from __future__ import annotations

import re

from torch import nn

from asyncserve.kernels.ops import KernelOps
from asyncserve.models.arch_config import ArchConfig
from asyncserve.models.llama import LlamaForCausalLM
from asyncserve.models.moe import SparseMoE, expert_target
from asyncserve.models.weights import Target

_MOE = re.compile(
    r"^(model\.layers\.(\d+))\.block_sparse_moe\.(input_linear|output_linear|router\.layer)"
    r"\.weight$"
)


class GraniteForCausalLM(LlamaForCausalLM):
    """Dense Granite: every difference from Llama is a config value."""


class GraniteMoeForCausalLM(LlamaForCausalLM):
    def make_mlp(self, config: ArchConfig, ops: KernelOps, layer: int) -> nn.Module:
        assert config.moe is not None
        return SparseMoE(config.hidden_size, config.moe, ops, self.placement)

    def route(self, hf_name: str) -> Target | None:
        match = _MOE.match(hf_name)
        if match is None:
            return super().route(hf_name)
        prefix, layer, part = match.groups()
        if part == "router.layer":
            return Target(f"{prefix}.mlp.gate.weight")
        moe = self.model.layers[int(layer)].mlp
        proj = "gate_up" if part == "input_linear" else "down"
        return expert_target(moe, f"{prefix}.mlp", proj, None)
