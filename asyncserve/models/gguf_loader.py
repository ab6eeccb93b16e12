"""Reading a GGUF file: metadata -> HF-style config dict, tensors -> HF-named fp32 weights.

llama.cpp stores Llama's q/k projection rows permuted (convert_hf_to_gguf's `permute`) so its
rotary kernel can use interleaved pairs; we undo that so the weights fit HF's rotate-half
layout. Granite and Mixtral files (both converted as Llama) are permuted too; Qwen2/Qwen3/
Qwen3-MoE/Gemma 3 files are written unpermuted. Stacked expert tensors (ffn_*_exps) go back
to each family's checkpoint names: one expert at a time for Qwen3-MoE (mlp.experts.{e}.*) and
Mixtral (an "llama" file with an expert count: block_sparse_moe.experts.{e}.w1/w3/w2), stacked
for GraniteMoE (gate and up joined again into block_sparse_moe.input_linear). Gemma 3's norm
weights, which llama.cpp stores as 1 + weight, go back to HF's convention. Phi-3 keeps its
fused qkv and gate_up tensors; its LongRoPE factors are tensors read into the config.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from asyncserve.models.arch_config import ArchConfig

# GGUF general.architecture -> HF architecture.
_GGUF_ARCHS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
# GGUF archs whose q/k rows convert_hf_to_gguf permutes (its LlamaModel and subclasses).
_PERMUTED_QK = {"llama", "mistral", "granite", "granitemoe"}
# Granite's multipliers: GGUF key (after "{arch}.") -> HF config name.
_GRANITE_SCALES = {
    "attention.scale": "attention_multiplier",
    "embedding_scale": "embedding_multiplier",
    "residual_scale": "residual_multiplier",
    "logit_scale": "logits_scaling",
}
# Mixtral's checkpoint names for the generic per-expert ones.
_MIXTRAL_PROJ = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Phi-3 keeps its fused checkpoint tensors: attn_qkv, and ffn_up holding gate and up rows.
_PHI3_NAMES = {**_BLOCK_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# Tensors that are config, not weights: Phi-3's LongRoPE factors.
_ROPE_FACTORS = {
    "rope_factors_short.weight": "short_factor",
    "rope_factors_long.weight": "long_factor",
}
# Gemma's ffn_norm is the norm before the MLP; Llama's sits after attention (the same place).
_GEMMA3_NAMES = {**_BLOCK_NAMES, "ffn_norm": "pre_feedforward_layernorm"}
# Stacked experts [E, out, in] -> HF's per-expert projection.
_EXPERT_NAMES = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
_GEMMA3_NORM_SHIFT = 1.0  # convert_hf_to_gguf adds it to every Gemma 3 norm weight
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


class _Reader(gguf.GGUFReader):
    """GGUFReader over a plain ndarray view of its memory map.

    GGUFReader slices its np.memmap once per metadata element, and numpy's memmap subclass
    hooks make that ~4x slower (12 s vs 3 s for a 49k-token vocabulary). The view shares the
    same mapped pages, so nothing is read eagerly.
    """

    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain = value.view(np.ndarray)


@dataclass
class GGUFFile:
    path: str
    reader: gguf.GGUFReader
    metadata: dict[str, Any]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


def open_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF file's header and metadata (tensor data stays memory-mapped)."""
    try:
        reader = _Reader(str(path))
        metadata = {name: field.contents() for name, field in reader.fields.items()}
    except OSError as e:
        raise ValueError(f"cannot read GGUF file {path}: {e}") from e
    except (ValueError, IndexError, KeyError, TypeError, OverflowError) as e:
        # What the reader's arrays say of a short or garbled file (a reshape that does not
        # fit, an offset past the end): the file is the problem, not the caller.
        detail = " ".join(str(e).split())
        raise ValueError(
            f"cannot read GGUF file {path}: the file is truncated or corrupt ({detail})"
        ) from e
    return GGUFFile(path=str(path), reader=reader, metadata=metadata)


def gguf_hf_config(g: GGUFFile) -> dict[str, Any]:
    """The HF config.json equivalent of the file's metadata."""
    arch = g.architecture
    if arch not in _GGUF_ARCHS:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_GGUF_ARCHS)}"
        )
    m = g.metadata

    def key(name: str, default: Any = None) -> Any:
        return m.get(f"{arch}.{name}", default)

    names = {t.name for t in g.reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(
            f"{g.path}: GGUF per-frequency rope factors (rope_freqs, Llama 3.1 style) "
            "are not supported"
        )
    tokens = m.get("tokenizer.ggml.tokens")
    vocab_size = len(tokens) if tokens is not None else key("vocab_size")
    heads = key("attention.head_count")
    hidden = key("embedding_length")
    rope_scaling = None
    if key("rope.scaling.type") == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    elif key("rope.scaling.type") not in (None, "none"):
        raise ValueError(f"{g.path}: rope scaling {key('rope.scaling.type')!r} is not supported")
    head_dim = key("attention.key_length")
    hf_arch = _GGUF_ARCHS[arch]
    if arch in ("llama", "mistral") and key("expert_count"):
        hf_arch = "MixtralForCausalLM"  # convert_hf_to_gguf writes Mixtral as llama
    config = {
        "architectures": [hf_arch],
        "model_type": arch,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": key("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": m.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": m.get("tokenizer.ggml.eos_token_id"),
        # Quantized weights are dequantized; their source precision is nearest to fp16.
        "torch_dtype": "float16",
    }
    if arch == "qwen3moe":
        moe_ff = key("expert_feed_forward_length")
        config.update(
            num_experts=key("expert_count"),
            num_experts_per_tok=key("expert_used_count"),
            moe_intermediate_size=moe_ff,
            # llama.cpp renormalises Qwen3-MoE's top-k weights unless told otherwise.
            norm_topk_prob=bool(key("expert_weights_norm", True)),
            intermediate_size=key("feed_forward_length") or moe_ff,
        )
    elif arch == "gemma3":
        config.update(_gemma3_config(key, config))
    elif arch == "phi3":
        config.update(_phi3_config(g, key, config))
    elif hf_arch in ("MixtralForCausalLM", "GraniteMoeForCausalLM"):
        # feed_forward_length is one expert's intermediate size here.
        config.update(
            num_local_experts=key("expert_count"), num_experts_per_tok=key("expert_used_count")
        )
    if arch in ("granite", "granitemoe"):
        config.update({hf: key(k) for k, hf in _GRANITE_SCALES.items() if key(k) is not None})
    return config


def _gemma3_config(key: Any, config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3 fields llama.cpp writes, or fixes in code where it writes none."""
    layers = int(config["num_hidden_layers"])
    pattern = key("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # newer files: one flag per layer, True for sliding
        layer_types = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:
        layer_types = [
            "sliding_attention" if (i + 1) % int(pattern) else "full_attention"
            for i in range(layers)
        ]
    # llama.cpp scales queries by hidden / heads for the 27B model (62 layers), else head_dim.
    scalar = config["hidden_size"] // config["num_attention_heads"] if layers == 62 else None
    return {
        "sliding_window": key("attention.sliding_window"),
        "layer_types": layer_types,
        "rope_local_base_freq": float(key("rope.freq_base_swa", 10000.0)),
        "query_pre_attn_scalar": scalar or config["head_dim"],
        "hidden_activation": "gelu_pytorch_tanh",
    }


def _phi3_config(g: GGUFFile, key: Any, config: dict[str, Any]) -> dict[str, Any]:
    """Phi-3: partial rotary (rope.dimension_count), a window on every layer, and LongRoPE
    when the file carries its factor tensors."""
    out: dict[str, Any] = {"sliding_window": key("attention.sliding_window")}
    head_dim = config["head_dim"] or config["hidden_size"] // config["num_attention_heads"]
    rotary = key("rope.dimension_count")
    if rotary is not None:
        out["partial_rotary_factor"] = int(rotary) / head_dim
    factors = {
        field: _tensor_values(g, t.name).tolist()
        for t in g.reader.tensors
        if (field := _ROPE_FACTORS.get(t.name)) is not None
    }
    if factors:
        if len(factors) != 2:
            raise ValueError(f"{g.path}: LongRoPE needs both rope_factors_short and _long")
        scaling: dict[str, Any] = {
            "rope_type": "longrope",
            **factors,
            "original_max_position_embeddings": key("rope.scaling.original_context_length"),
        }
        if key("rope.scaling.attn_factor") is not None:
            scaling["attention_factor"] = float(key("rope.scaling.attn_factor"))
        out["rope_scaling"] = scaling
    return out


def _tensor_values(g: GGUFFile, name: str) -> np.ndarray:
    (t,) = (t for t in g.reader.tensors if t.name == name)
    return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float64).ravel()


def _hf_name(gguf_name: str, arch: str = "llama") -> str:
    """HF name of a GGUF tensor; for stacked experts, with "{expert}" left to fill."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = {"gemma3": _GEMMA3_NAMES, "phi3": _PHI3_NAMES}.get(arch, _BLOCK_NAMES)
    match = _BLOCK_RE.match(gguf_name)
    if match is None or (match.group(2) not in names and match.group(2) not in _EXPERT_NAMES):
        raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
    layer, part, kind = match.groups()
    if part in _EXPERT_NAMES:
        return f"model.layers.{layer}.mlp.experts.{{expert}}.{_EXPERT_NAMES[part]}.{kind}"
    return f"model.layers.{layer}.{names[part]}.{kind}"


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf's permute: reshape(n_head, 2, rows/n_head/2, ...)
    .swapaxes(1, 2) took each head's rotate-half rows to interleaved pairs; swap back."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def linear_tensor_types(g: GGUFFile) -> dict[str, gguf.GGMLQuantizationType]:
    """HF module name -> GGML type of each 2-D weight (not stacked experts): what
    quantization="gguf" decides from which layers it keeps quantized."""
    out = {}
    for t in g.reader.tensors:
        if t.name in _ROPE_FACTORS or len(t.shape) != 2 or not t.name.endswith(".weight"):
            continue
        name = _hf_name(t.name, g.architecture)
        if "{expert}" not in name:
            out[name.removesuffix(".weight")] = gguf.GGMLQuantizationType(t.tensor_type)
    return out


def iter_gguf_weights(
    g: GGUFFile, config: ArchConfig, raw: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, fp32 CPU tensor) one tensor at a time, dequantized and unpermuted,
    under the names config.architecture's checkpoints use. Tensors whose HF name `raw`
    accepts come as their GGUF blocks instead: uint8 [rows, blocks, block bytes], rows
    unpermuted."""
    permuted = g.architecture in _PERMUTED_QK
    family = config.architecture
    # GraniteMoE: a layer's stacked gate (or up) experts wait for the other half.
    pending: dict[str, torch.Tensor] = {}
    for t in g.reader.tensors:
        if t.name in _ROPE_FACTORS:
            continue  # read into the config
        name = _hf_name(t.name, g.architecture)
        if raw is not None and raw(name):
            yield name, torch.from_numpy(_raw_rows(t, name, config, permuted))
            continue
        try:
            values = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ValueError(f"{g.path}: tensor {t.name}: {e}") from e
        # GGUF lists dimensions innermost first; numpy wants them outermost first.
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        values = values.reshape(shape)
        if permuted and ".self_attn.q_proj." in name:
            values = _unpermute(values, config.num_attention_heads)
        elif permuted and ".self_attn.k_proj." in name:
            values = _unpermute(values, config.num_key_value_heads)
        values = np.ascontiguousarray(values, dtype=np.float32)
        if g.architecture == "gemma3" and name.endswith("norm.weight"):
            values = values - _GEMMA3_NORM_SHIFT
        if not values.flags.writeable:  # an F32 tensor is a view of the read-only map
            values = values.copy()
        tensor = torch.from_numpy(values)
        if family == "GraniteMoeForCausalLM":
            yield from _granite_moe_tensors(name, tensor, pending)
        elif "{expert}" in name:
            for expert in range(tensor.shape[0]):
                yield _family_name(name.format(expert=expert), family), tensor[expert]
        else:
            yield _family_name(name, family), tensor
    if pending:
        raise ValueError(f"{g.path}: expert gate and up halves unpaired: {sorted(pending)}")


def _raw_rows(t: Any, name: str, config: ArchConfig, permuted: bool) -> np.ndarray:
    """A quantized tensor's blocks, row by row ([rows, blocks, block bytes], so that a
    tensor-parallel rank can take whole blocks of each row); q/k rows unpermuted."""
    block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t.tensor_type)][1]
    rows = np.asarray(t.data).reshape(int(t.shape[-1]), -1, block_bytes)
    if permuted and ".self_attn.q_proj." in name:
        rows = _unpermute(rows, config.num_attention_heads)
    elif permuted and ".self_attn.k_proj." in name:
        rows = _unpermute(rows, config.num_key_value_heads)
    return np.array(rows, copy=True)  # writable and contiguous: the map is read-only


def _family_name(name: str, family: str) -> str:
    """Mixtral names its router and experts block_sparse_moe.gate / experts.{e}.w1|w3|w2."""
    if family != "MixtralForCausalLM" or ".mlp." not in name:
        return name
    if name.endswith(".mlp.gate.weight"):
        return name.replace(".mlp.gate.", ".block_sparse_moe.gate.")
    if ".mlp.experts." in name:
        head, proj, kind = name.rsplit(".", 2)
        return f"{head.replace('.mlp.', '.block_sparse_moe.')}.{_MIXTRAL_PROJ[proj]}.{kind}"
    return name


def _granite_moe_tensors(
    name: str, tensor: torch.Tensor, pending: dict[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """GraniteMoE's stacked names: input_linear [E, 2I, H] (gate rows, then up rows),
    output_linear [E, H, I], router.layer. `pending` holds a layer's gate or up experts
    until the other half is read."""
    if "{expert}" not in name:
        if name.endswith(".mlp.gate.weight"):
            name = name.replace(".mlp.gate.", ".block_sparse_moe.router.layer.")
        yield name, tensor
        return
    layer = name.split(".mlp.")[0]
    if ".down_proj." in name:
        yield f"{layer}.block_sparse_moe.output_linear.weight", tensor
        return
    half = "gate" if ".gate_proj." in name else "up"
    other = pending.pop(f"{layer}:{'up' if half == 'gate' else 'gate'}", None)
    if other is None:
        pending[f"{layer}:{half}"] = tensor
        return
    gate, up = (tensor, other) if half == "gate" else (other, tensor)
    yield f"{layer}.block_sparse_moe.input_linear.weight", torch.cat([gate, up], dim=1)
