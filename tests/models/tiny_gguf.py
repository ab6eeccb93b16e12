"""Write a tiny GGUF file from HF-named weights, the way llama.cpp's converter lays it out."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch

from asyncserve.tokenizer import bytes_to_unicode

# Two control tokens, the 256 bytes, and two merged tokens: 260 ids.
TOKENS = ["<s>", "</s>", *bytes_to_unicode().values(), "he", "Ġt"]
MERGES = ["h e", "Ġ t"]
CHATML = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)

_BLOCK_PARTS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.router": "ffn_gate_inp",  # GraniteMoE
    "self_attn.qkv_proj": "attn_qkv",  # Phi-3's fused tensors
    "mlp.gate_up_proj": "ffn_up",
}
# convert_hf_to_gguf's LlamaModel and its subclasses permute q/k (Mixtral is written as llama).
PERMUTED_ARCHS = ("llama", "granite", "granitemoe")
_GEMMA3_PARTS = {
    **_BLOCK_PARTS,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    part, kind = rest.rsplit(".", 1)
    parts = _GEMMA3_PARTS if arch == "gemma3" else _BLOCK_PARTS
    return f"blk.{layer}.{parts[part]}.{kind}"


def gguf_tensors(
    arch: str, state: dict[str, torch.Tensor], heads: int, kv_heads: int
) -> dict[str, np.ndarray]:
    """GGUF-named arrays as llama.cpp's converter writes them: Llama's q/k permuted, Gemma 3's
    norms shifted by 1, each layer's experts stacked into one [E, out, in] tensor."""
    out: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, tensor in state.items():
        array = tensor.detach().float().numpy()
        if name.endswith(".experts.gate_up_proj"):  # transformers 5 keeps experts fused
            layer = name.split(".")[2]
            gate, up = np.split(array, 2, axis=1)
            out[f"blk.{layer}.ffn_gate_exps.weight"] = gate
            out[f"blk.{layer}.ffn_up_exps.weight"] = up
            continue
        if name.endswith(".experts.down_proj"):
            out[f"blk.{name.split('.')[2]}.ffn_down_exps.weight"] = array
            continue
        match = _EXPERT.match(name)
        if match:
            layer, expert, proj = match.groups()
            experts.setdefault(f"blk.{layer}.ffn_{proj}_exps.weight", {})[int(expert)] = array
            continue
        if arch in PERMUTED_ARCHS and name.endswith("self_attn.q_proj.weight"):
            array = llama_cpp_permute(array, heads)
        elif arch in PERMUTED_ARCHS and name.endswith("self_attn.k_proj.weight"):
            array = llama_cpp_permute(array, kv_heads)
        elif arch == "gemma3" and name.endswith("norm.weight"):
            array = array + 1.0
        out[gguf_name(name, arch)] = array
    for name, by_expert in experts.items():
        out[name] = np.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def quantize(array: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """gguf.quants.quantize, plus Q4_K, which gguf-py cannot quantize."""
    if qtype == gguf.GGMLQuantizationType.Q4_K:
        return quantize_q4_k(array)
    return np.asarray(gguf.quants.quantize(array, qtype))


def quantize_q4_k(array: np.ndarray) -> np.ndarray:
    """[rows, K] -> Q4_K blocks uint8 [rows, K / 256 * 144] (llama.cpp's block_q4_K: fp16 d
    and dmin, eight 6-bit scale / min pairs in 12 bytes, 128 bytes of nibbles), with plain
    min / max scales per 32 values: w ~ d * sc * q - dmin * m."""
    rows, k = array.shape
    x = array.astype(np.float32).reshape(rows, k // 256, 8, 32)
    low = np.minimum(x.min(-1), 0.0)
    step = (x.max(-1) - low) / 15  # [rows, blocks, 8]
    d = np.maximum(step.max(-1), 1e-8) / 63
    dmin = np.maximum(-low.min(-1), 1e-8) / 63
    d, dmin = d.astype(np.float16), dmin.astype(np.float16)
    sc = np.clip(np.round(step / d.astype(np.float32)[..., None]), 1, 63).astype(np.uint8)
    m = np.clip(np.round(-low / dmin.astype(np.float32)[..., None]), 0, 63).astype(np.uint8)
    scale = (d.astype(np.float32)[..., None] * sc)[..., None]
    offset = (dmin.astype(np.float32)[..., None] * m)[..., None]
    q = np.clip(np.round((x + offset) / scale), 0, 15).astype(np.uint8)  # [r, b, 8, 32]
    packed = np.empty((rows, k // 256, 12), dtype=np.uint8)
    packed[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    packed[..., 4:8] = m[..., :4] | ((m[..., 4:] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:] & 0xF) | ((m[..., 4:] & 0xF) << 4)
    pairs = q.reshape(rows, k // 256, 4, 2, 32)  # each 64 values: low nibbles, then high
    qs = (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).reshape(rows, k // 256, 128)
    halves = np.stack([d, dmin], axis=-1).view(np.uint8)  # [r, b, 4]
    return np.concatenate([halves, packed, qs], axis=-1).reshape(rows, -1)


def write_tiny_gguf(
    path: Path,
    arch: str,
    state: dict[str, torch.Tensor],
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    rope_theta: float,
    eps: float,
    context: int = 256,
    extra: Callable[[gguf.GGUFWriter], None] | None = None,
    feed_forward_length: int | None = None,
    tensor_type: Callable[[str], gguf.GGMLQuantizationType | None] | None = None,
) -> None:
    """feed_forward_length: what the converter writes when it is not the dense MLP's width
    (Mixtral and GraniteMoE write one expert's); tensor_type: the type to quantize a GGUF
    tensor to with gguf.quants (None: F32)."""
    hidden = state["model.embed_tokens.weight"].shape[1]
    layers = 1 + max(int(n.split(".")[2]) for n in state if n.startswith("model.layers."))
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    dense_up = [t for n, t in state.items() if n.endswith(".mlp.up_proj.weight")]
    if feed_forward_length is None:
        feed_forward_length = dense_up[0].shape[0] if dense_up else 0
    w.add_feed_forward_length(feed_forward_length)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_layer_norm_rms_eps(eps)
    w.add_rope_freq_base(rope_theta)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_types([3, 3] + [1] * (len(TOKENS) - 2))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(True)
    w.add_chat_template(CHATML)
    if extra is not None:
        extra(w)
    for name, array in gguf_tensors(arch, state, heads, kv_heads).items():
        qtype = tensor_type(name) if tensor_type is not None else None
        if qtype is None:
            w.add_tensor(name, np.ascontiguousarray(array))
        else:
            w.add_tensor(name, quantize(array, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
