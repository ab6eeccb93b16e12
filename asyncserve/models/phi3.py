"""Phi-3: the Llama decoder as its checkpoint already stores it, with q/k/v fused in
self_attn.qkv_proj and gate/up in mlp.gate_up_proj (gate rows first), so those tensors load
as they are. What else differs is config: partial rotary (partial_rotary_factor), LongRoPE
scaling (rope_scaling type longrope, or its first name su) and a sliding window on every
layer when the config sets one.
"""

from __future__ import annotations

from asyncserve.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 / Phi-3.5 / Phi-4-mini dense models."""
