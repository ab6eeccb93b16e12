"""Granite and GraniteMoE (PowerMoE): the Llama decoder with four multipliers, which the
shared Llama layers apply from the config: embeddings x embedding_multiplier, each residual
branch x residual_multiplier, attention_multiplier as the softmax scale, logits /
logits_scaling. GraniteMoE replaces every MLP with a sparse MoE whose experts the checkpoint
stacks: block_sparse_moe.input_linear [E, 2I, H] (gate rows, then up rows),
block_sparse_moe.output_linear [E, H, I] and the router block_sparse_moe.router.layer.
The stacked tensors load expert by expert (so that a tensor-parallel rank can take its slice
of each expert, or only its experts).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from asyncserve.kernels.ops import KernelOps
from asyncserve.models.arch_config import ArchConfig
from asyncserve.models.llama import LlamaForCausalLM
from asyncserve.models.moe import SparseMoE, expert_target
from asyncserve.models.weights import Target, load_checkpoint

_MOE = re.compile(
    r"^(model\.layers\.(\d+))\.block_sparse_moe\.(input_linear|output_linear|router\.layer)"
    r"\.weight$"
)
# One expert's part of a stacked tensor, as load_weights names it.
_EXPERT = re.compile(r"^(model\.layers\.(\d+))\.block_sparse_moe\.experts\.(\d+)\.(gate|up|down)$")


class GraniteForCausalLM(LlamaForCausalLM):
    """Dense Granite: every difference from Llama is a config value."""


class GraniteMoeForCausalLM(LlamaForCausalLM):
    def make_mlp(self, config: ArchConfig, ops: KernelOps, layer: int) -> nn.Module:
        assert config.moe is not None
        return SparseMoE(config.hidden_size, config.moe, ops, self.placement, tp=self.tp)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_checkpoint(self, self._per_expert(weights), self.route)

    def _per_expert(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        size = self.config.moe.intermediate_size if self.config.moe is not None else 0
        for name, tensor in weights:
            match = _MOE.match(name)
            if match is None or match.group(3) == "router.layer":
                yield name, tensor
                continue
            prefix = f"{match.group(1)}.block_sparse_moe.experts"
            for e in range(tensor.shape[0]):
                if match.group(3) == "output_linear":
                    yield f"{prefix}.{e}.down", tensor[e]
                else:
                    yield f"{prefix}.{e}.gate", tensor[e, :size]
                    yield f"{prefix}.{e}.up", tensor[e, size:]

    def route(self, hf_name: str) -> Target | None:
        match = _EXPERT.match(hf_name)
        if match is not None:
            prefix, layer, expert, proj = match.groups()
            moe = self.model.layers[int(layer)].mlp
            return expert_target(moe, f"{prefix}.mlp", proj, int(expert))
        match = _MOE.match(hf_name)
        if match is None:
            return super().route(hf_name)
        if match.group(3) == "router.layer":
            return Target(f"{match.group(1)}.mlp.gate.weight")
        # A stacked tensor, read whole and split by load_weights.
        return Target(hf_name)

    def checkpoint_slice(self, hf_name: str) -> tuple[int, int, int] | None:
        return None if _MOE.match(hf_name) else super().checkpoint_slice(hf_name)
