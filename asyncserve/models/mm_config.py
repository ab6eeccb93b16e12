"""Configs of multimodal checkpoints: the language model's part as an ArchConfig.

A vision-language config nests its language model's config (`text_config`) beside the
vision tower's (`vision_config`). The engine's shape (KV pool, scheduler) is the language
model's; the model class reads the rest from ArchConfig.multimodal_config (the whole dict).
Older checkpoints save only the fields that differ from the transformers defaults, which
are filled in here.
"""

from __future__ import annotations

from typing import Any

# transformers' LlamaConfig / MistralConfig defaults, for text_configs saved as a diff.
_TEXT_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
    },
    "mistral": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096 * 32,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
    },
}

# Multimodal architectures whose language model is described by `text_config`.
NESTED_TEXT_CONFIG = ("LlavaForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")


def text_config_dict(d: dict[str, Any]) -> dict[str, Any]:
    """The language model's HF config dict of a multimodal config `d`."""
    text = d.get("text_config") or {}
    if not isinstance(text, dict):
        raise ValueError("text_config must be an object")
    if d.get("model_type") == "qwen2_5_vl":
        text = _qwen2_5_vl_text(d, text)
    model_type = str(text.get("model_type") or "llama")
    out = {**_TEXT_DEFAULTS.get(model_type, {}), **text, "model_type": model_type}
    # The outer config carries the dtype and, in older layouts, the token ids.
    for key in ("torch_dtype", "dtype", "bos_token_id", "eos_token_id"):
        if key not in out and d.get(key) is not None:
            out[key] = d[key]
    if "tie_word_embeddings" in d and "tie_word_embeddings" not in text:
        out["tie_word_embeddings"] = d["tie_word_embeddings"]
    return out


def _qwen2_5_vl_text(d: dict[str, Any], text: dict[str, Any]) -> dict[str, Any]:
    """Qwen2.5-VL's language model is Qwen2 (q/k/v biases) with M-RoPE; older configs keep
    its fields at the top level rather than in text_config."""
    if not text:
        text = {k: v for k, v in d.items() if k not in ("vision_config", "architectures")}
    return {**text, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}
