"""Architecture name (as config.json's "architectures" spells it) -> model class.

Model modules are imported on first use so that reading a config never imports torch modules
it does not need, and so arch_config.py can name the supported set without an import cycle.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # base imports arch_config, which imports this module
    from asyncserve.models.base import CausalLM

# architecture -> (module under asyncserve.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "GraniteForCausalLM": ("granite", "GraniteForCausalLM"),
    "GraniteMoeForCausalLM": ("granite", "GraniteMoeForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "OPTForCausalLM": ("opt", "OPTForCausalLM"),
    "LlavaForConditionalGeneration": ("llava", "LlavaForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
}

# model_type -> architecture, for configs that do not list "architectures".
MODEL_TYPE_TO_ARCH: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "granite": "GraniteForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "opt": "OPTForCausalLM",
    "llava": "LlavaForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_MODELS)


def unsupported_message(arch: str) -> str:
    return (
        f"unsupported model architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def resolve_model_class(arch: str) -> type[CausalLM]:
    """The class implementing `arch`; ValueError naming it and the supported ones otherwise."""
    entry = _MODELS.get(arch)
    if entry is None:
        raise ValueError(unsupported_message(arch))
    module = importlib.import_module(f"asyncserve.models.{entry[0]}")
    cls: type[CausalLM] = getattr(module, entry[1])
    return cls
