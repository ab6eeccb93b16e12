"""ArchConfig: the model shape the engine needs, read from an HF config.json dict.

One reader for every source: GGUF metadata is translated into the same HF-style dict first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncserve.models.registry import (
    MODEL_TYPE_TO_ARCH,
    SUPPORTED_ARCHITECTURES,
    unsupported_message,
)

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    torch_dtype: str
    bos_token_id: int | None
    eos_token_ids: list[int]

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rms_norm_eps <= 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ArchConfig:
        arch = _architecture(d)
        model_type = str(d.get("model_type") or "")
        hidden = _int(d, "hidden_size")
        heads = _int(d, "num_attention_heads")
        kv_heads = d.get("num_key_value_heads")
        head_dim = d.get("head_dim")
        if head_dim is None:
            if hidden % heads:
                raise ValueError(
                    f"head_dim is missing and hidden_size ({hidden}) is not a multiple of "
                    f"num_attention_heads ({heads})"
                )
            head_dim = hidden // heads
        max_pos = _int(d, "max_position_embeddings", 2048)
        # The engine runs full attention only. A sliding window that covers the whole context
        # (or none) changes nothing; a smaller one is exact only up to the window, so the usable
        # context is capped there rather than silently computing something else.
        window = d.get("sliding_window")
        uses_window = d.get("use_sliding_window", True)
        if window is not None and uses_window and int(window) < max_pos:
            max_pos = int(window)
        theta, scaling = _rope(d)
        eos = d.get("eos_token_id")
        if eos is None:
            eos_ids: list[int] = []
        elif isinstance(eos, int):
            eos_ids = [eos]
        elif isinstance(eos, list) and all(isinstance(e, int) for e in eos):
            eos_ids = list(eos)
        else:
            raise ValueError(f"eos_token_id must be an int or a list of ints, got {eos!r}")
        bos = d.get("bos_token_id")
        if isinstance(bos, list):
            bos = bos[0] if bos else None
        dtype = d.get("torch_dtype") or d.get("dtype") or "float32"
        return cls(
            architecture=arch,
            model_type=model_type,
            vocab_size=_int(d, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_int(d, "intermediate_size"),
            num_hidden_layers=_int(d, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=int(kv_heads) if kv_heads is not None else heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; its config does not say so.
            attention_bias=arch == "Qwen2ForCausalLM" or bool(d.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            torch_dtype=str(dtype),
            bos_token_id=bos,
            eos_token_ids=eos_ids,
        )

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


def _architecture(d: dict[str, Any]) -> str:
    archs = d.get("architectures")
    if archs:
        if not isinstance(archs, list):
            raise ValueError(f"architectures must be a list, got {archs!r}")
        for arch in archs:
            if arch in SUPPORTED_ARCHITECTURES:
                return str(arch)
        raise ValueError(unsupported_message(str(archs[0])))
    model_type = d.get("model_type")
    if model_type in MODEL_TYPE_TO_ARCH:
        return MODEL_TYPE_TO_ARCH[model_type]
    raise ValueError(unsupported_message(f"model_type={model_type}"))


def _int(d: dict[str, Any], name: str, default: int | None = None) -> int:
    value = d.get(name, default)
    if value is None:
        raise ValueError(f"{name} is missing from the model config")
    if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value:
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


def _rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None), from old (rope_theta + rope_scaling) or new
    (rope_parameters) transformers config layouts."""
    params = d.get("rope_parameters")
    scaling = d.get("rope_scaling")
    theta = d.get("rope_theta")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling is not None and not isinstance(scaling, dict):
        raise ValueError(f"rope_scaling must be an object or null, got {scaling!r}")
    if scaling:
        scaling = dict(scaling)
        rope_type = scaling.pop("type", None) or scaling.get("rope_type") or "default"
        scaling["rope_type"] = rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_scaling type {rope_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if rope_type == "default":
            scaling = None
    else:
        scaling = None
    return float(theta if theta is not None else 10000.0), scaling
