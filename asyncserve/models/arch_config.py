"""ArchConfig: the model shape the engine needs, read from an HF config.json dict.

One reader for every source: GGUF metadata is translated into the same HF-style dict first.
Family-specific fields (MoE routing, Granite multipliers, Gemma 3 windows and soft caps, OPT
layout) have defaults that leave a plain Llama unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from asyncserve.models.mm_config import NESTED_TEXT_CONFIG, text_config_dict
from asyncserve.models.registry import (
    MODEL_TYPE_TO_ARCH,
    SUPPORTED_ARCHITECTURES,
    unsupported_message,
)

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
# Families whose attention applies the config's sliding window itself (per layer); the others
# cap the usable context at the window instead.
_WINDOWED = {
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Phi3ForCausalLM",
    "Gemma3ForCausalLM",
}
# The MLP activation each family implements; anything else is rejected by name.
_ACTIVATIONS = {
    "OPTForCausalLM": ("relu",),
    "Gemma3ForCausalLM": ("gelu_pytorch_tanh",),
}
_DEFAULT_ACTIVATIONS = ("silu",)
# Families whose HF config class ties the head to the embeddings unless told otherwise.
_TIED_BY_DEFAULT = {"Gemma3ForCausalLM", "OPTForCausalLM"}
SLIDING = "sliding_attention"


@dataclass(frozen=True)
class MoEArch:
    """Sparse MLP shape and routing."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    renormalize: bool  # rescale each token's top-k weights to sum to 1
    scoring: str = "softmax"  # or "sigmoid"
    decoder_sparse_step: int = 1  # every n-th layer is sparse (Qwen-MoE)
    mlp_only_layers: tuple[int, ...] = ()  # layers kept dense (Qwen-MoE)

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


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
    hidden_act: str = "silu"
    partial_rotary_factor: float = 1.0  # share of each head's dims that rotary turns
    attention_scale: float | None = None  # None: head_dim ** -0.5
    # A window applies to every layer, or only to the "sliding_attention" ones of layer_types.
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float | None = None  # rotary base of sliding layers (Gemma 3)
    final_logit_softcap: float | None = None
    # Granite: embeddings, each residual branch and the logits are scaled.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0  # logits are divided by it
    moe: MoEArch | None = None
    # OPT: embeddings narrower than the hidden size, post-norm layers, learned positions.
    word_embed_proj_dim: int | None = None
    do_layer_norm_before: bool = True
    # M-RoPE (Qwen2-VL family): rotary frequencies turned by the temporal / height / width
    # position rows, in parts of these sizes (summing to head_dim / 2); () is plain RoPE.
    mrope_section: tuple[int, ...] = ()
    # A multimodal model: its language model's architecture (the shape above is that
    # model's) and the whole HF config, vision part included (see models/mm_config.py).
    text_architecture: str | None = None
    multimodal_config: dict[str, Any] | None = None

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
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for "
                f"{self.num_hidden_layers} layers"
            )
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise ValueError(
                f"partial_rotary_factor {self.partial_rotary_factor} gives an odd or empty "
                f"rotary dimension for head_dim {self.head_dim}"
            )

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ArchConfig:
        arch = _architecture(d)
        if arch in NESTED_TEXT_CONFIG:
            text = cls.from_hf_dict(text_config_dict(d))
            return dataclasses.replace(
                text,
                architecture=arch,
                model_type=str(d.get("model_type") or ""),
                text_architecture=text.architecture,
                multimodal_config=d,
            )
        model_type = str(d.get("model_type") or "")
        hidden = _int(d, "hidden_size")
        heads = _int(d, "num_attention_heads")
        kv_heads = _int(d, "num_key_value_heads", heads)
        head_dim = d.get("head_dim")
        if head_dim is None:
            if heads < 1:  # before dividing by it (__post_init__ names the others)
                raise ValueError(f"num_attention_heads must be a positive integer, got {heads}")
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
        if window is not None:
            window = _int(d, "sliding_window")
            if window < 1:  # before it caps the context (a 0 would blame max_position_embeddings)
                raise ValueError(f"sliding_window must be >= 1, got {window}")
        uses_window = d.get("use_sliding_window", True)
        if not uses_window or arch not in _WINDOWED:
            if window is not None and uses_window and window < max_pos:
                max_pos = window
            window = None
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
            intermediate_size=_int(
                d, "ffn_dim" if arch == "OPTForCausalLM" else "intermediate_size"
            ),
            num_hidden_layers=_int(d, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=_int(d, "head_dim", head_dim),
            rms_norm_eps=_float(d, "rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", arch in _TIED_BY_DEFAULT)),
            # Qwen2 always has q/k/v biases; its config does not say so.
            attention_bias=arch == "Qwen2ForCausalLM" or bool(d.get("attention_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            torch_dtype=str(dtype),
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            hidden_act=_activation(arch, d),
            partial_rotary_factor=_number(
                d.get("partial_rotary_factor")
                or (d.get("rope_parameters") or {}).get("partial_rotary_factor")
                or 1.0,
                "partial_rotary_factor",
            ),
            sliding_window=window,
            mrope_section=_mrope_section(d),
            **_family_fields(arch, d),
        )

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of one layer, or None for global attention."""
        if self.layer_types and self.layer_types[layer] != SLIDING:
            return None
        return self.sliding_window

    def is_sliding(self, layer: int) -> bool:
        return self.layer_window(layer) is not None

    @property
    def kv_sliding_window(self) -> int | None:
        """The window the KV cache may drop blocks behind: set only when every layer uses a
        window (the widest one). One global layer (Gemma 3) reads every block, so None."""
        windows = [self.layer_window(layer) for layer in range(self.num_hidden_layers)]
        if not windows or any(w is None for w in windows):
            return None
        return max(w for w in windows if w is not None)


def _activation(arch: str, d: dict[str, Any]) -> str:
    act = str(
        d.get("hidden_act") or d.get("hidden_activation") or d.get("activation_function") or ""
    )
    allowed = _ACTIVATIONS.get(arch, _DEFAULT_ACTIVATIONS)
    if not act:
        return allowed[0]
    if act not in allowed:
        raise ValueError(f"{arch}: activation {act!r} is not supported (supported: {allowed})")
    return act


def _family_fields(arch: str, d: dict[str, Any]) -> dict[str, Any]:
    """The ArchConfig fields only some families have, read from their HF names."""
    out: dict[str, Any] = {}
    if arch in ("MixtralForCausalLM", "GraniteMoeForCausalLM"):
        out["moe"] = MoEArch(
            num_experts=_int(d, "num_local_experts"),
            top_k=_int(d, "num_experts_per_tok"),
            intermediate_size=_int(d, "intermediate_size"),
            renormalize=True,
        )
    elif arch == "Qwen3MoeForCausalLM":
        out["moe"] = MoEArch(
            # Hub configs say num_experts; transformers 5 writes num_local_experts.
            num_experts=_int(d, "num_experts", d.get("num_local_experts")),
            top_k=_int(d, "num_experts_per_tok"),
            intermediate_size=_int(d, "moe_intermediate_size"),
            renormalize=bool(d.get("norm_topk_prob", False)),  # HF's default
            decoder_sparse_step=_int(d, "decoder_sparse_step", 1),
            mlp_only_layers=tuple(int(i) for i in d.get("mlp_only_layers") or ()),
        )
    if arch in ("GraniteForCausalLM", "GraniteMoeForCausalLM"):
        out["embedding_multiplier"] = _float(d, "embedding_multiplier", 1.0)
        out["residual_multiplier"] = _float(d, "residual_multiplier", 1.0)
        out["logits_scaling"] = _float(d, "logits_scaling", 1.0)
        out["attention_scale"] = _float(d, "attention_multiplier", 1.0)
    if arch == "Gemma3ForCausalLM":
        out.update(_gemma3_fields(d))
    if arch == "OPTForCausalLM":
        if not d.get("enable_bias", True) or not d.get("layer_norm_elementwise_affine", True):
            raise ValueError("OPTForCausalLM without biases or norm weights is not supported")
        out["word_embed_proj_dim"] = _int(d, "word_embed_proj_dim", _int(d, "hidden_size"))
        out["do_layer_norm_before"] = bool(d.get("do_layer_norm_before", True))
        if d.get("_remove_final_layer_norm"):
            raise ValueError("OPTForCausalLM with _remove_final_layer_norm is not supported")
    return out


def _gemma3_fields(d: dict[str, Any]) -> dict[str, Any]:
    if d.get("use_bidirectional_attention"):
        raise ValueError("Gemma3ForCausalLM: use_bidirectional_attention is not supported")
    layers = _int(d, "num_hidden_layers")
    layer_types = d.get("layer_types")
    if not layer_types:
        # Older configs give the pattern: every n-th layer is global.
        pattern = _int(d, "sliding_window_pattern", 6)
        layer_types = [SLIDING if (i + 1) % pattern else "full_attention" for i in range(layers)]
    # attn_logit_softcapping is left out, as HF's Gemma 3 leaves it out: Gemma 3 replaced
    # Gemma 2's attention soft cap by q/k norms, and released configs set it to null.
    local_theta = d.get("rope_local_base_freq", 10000.0)
    params = d.get("rope_parameters")
    if isinstance(params, dict) and SLIDING in params:
        local = params[SLIDING] or {}
        if (local.get("rope_type") or "default") != "default":
            raise ValueError(
                f"Gemma3ForCausalLM: rope type {local.get('rope_type')!r} on sliding layers "
                "is not supported"
            )
        local_theta = local.get("rope_theta", local_theta)
    return {
        "layer_types": tuple(str(t) for t in layer_types),
        "rope_local_theta": _number(local_theta, "rope_local_base_freq"),
        "attention_scale": _float(d, "query_pre_attn_scalar", 256) ** -0.5,
        "final_logit_softcap": _optional_float(d, "final_logit_softcapping"),
    }


def _optional_float(d: dict[str, Any], name: str) -> float | None:
    return None if d.get(name) is None else _float(d, name, 0.0)


def _number(value: Any, name: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None


def _float(d: dict[str, Any], name: str, default: float) -> float:
    return _number(d.get(name, default), name)


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
    value = default if d.get(name) is None else d[name]  # absent or null: the default
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
    if isinstance(params, dict) and "full_attention" in params:
        params = params["full_attention"]  # per-layer-type layout (Gemma 3): global layers
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling is not None and not isinstance(scaling, dict):
        raise ValueError(f"rope_scaling must be an object or null, got {scaling!r}")
    if scaling:
        scaling = dict(scaling)
        rope_type = scaling.pop("type", None) or scaling.get("rope_type") or "default"
        if rope_type == "su":  # Phi-3's first name for longrope
            rope_type = "longrope"
        if rope_type == "mrope" or scaling.pop("mrope_section", None) is not None:
            rope_type = "default"  # M-RoPE's frequencies are the default ones (_mrope_section)
        scaling["rope_type"] = rope_type
        scaling.pop("partial_rotary_factor", None)  # read on its own
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_scaling type {rope_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        factor = scaling.get("factor")
        if factor is not None and not _number(factor, "rope_scaling factor") > 0:
            raise ValueError(f"rope_scaling factor must be > 0, got {factor!r}")
        if rope_type == "longrope":
            scaling = _longrope(scaling, d)
        if rope_type == "default":
            scaling = None
    else:
        scaling = None
    return _number(theta if theta is not None else 10000.0, "rope_theta"), scaling


def _mrope_section(d: dict[str, Any]) -> tuple[int, ...]:
    for key in ("rope_parameters", "rope_scaling"):
        params = d.get(key)
        if isinstance(params, dict) and params.get("mrope_section") is not None:
            section = params["mrope_section"]
            if not isinstance(section, list) or not all(isinstance(n, int) for n in section):
                raise ValueError(f"mrope_section must be a list of ints, got {section!r}")
            return tuple(section)
    return ()


def _longrope(scaling: dict[str, Any], d: dict[str, Any]) -> dict[str, Any]:
    """Complete a longrope (Phi-3) scaling dict with its original context and the attention
    factor HF derives from the context ratio (before any window cap)."""
    original = scaling.get("original_max_position_embeddings") or d.get(
        "original_max_position_embeddings"
    )
    if original is None:
        raise ValueError("longrope rope_scaling needs original_max_position_embeddings")
    for key in ("short_factor", "long_factor"):
        if not isinstance(scaling.get(key), list):
            raise ValueError(f"longrope rope_scaling needs a {key} list")
    factor = scaling.get("factor") or _int(d, "max_position_embeddings") / int(original)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(int(original)))
        )
    return {
        **scaling,
        "original_max_position_embeddings": int(original),
        "attention_factor": float(attention_factor),
    }
