"""Phi-3: the Llama decoder as its checkpoint already stores it, with q/k/v fused in
self_attn.qkv_proj and gate/up in mlp.gate_up_proj (gate rows first). The fused tensors are
split into HF's q/k/v and gate/up names on load, so that they load, and slice under tensor
parallelism, as Llama's do. What else differs is config: partial rotary
(partial_rotary_factor), LongRoPE scaling (rope_scaling type longrope, or its first name su)
and a sliding window on every layer when the config sets one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from asyncserve.models.llama import LlamaForCausalLM
from asyncserve.models.weights import load_checkpoint


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 / Phi-3.5 / Phi-4-mini dense models."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_checkpoint(self, self._split_fused(weights), self.route)

    def _split_fused(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        c = self.config
        kv = c.num_key_value_heads * c.head_dim
        for name, tensor in weights:
            if ".self_attn.qkv_proj." in name:
                q, k, v = tensor.split([c.q_size, kv, kv])
                yield name.replace(".qkv_proj.", ".q_proj."), q
                yield name.replace(".qkv_proj.", ".k_proj."), k
                yield name.replace(".qkv_proj.", ".v_proj."), v
            elif ".mlp.gate_up_proj." in name:
                gate, up = tensor.split([c.intermediate_size] * 2)
                yield name.replace(".gate_up_proj.", ".gate_proj."), gate
                yield name.replace(".gate_up_proj.", ".up_proj."), up
            else:
                yield name, tensor
