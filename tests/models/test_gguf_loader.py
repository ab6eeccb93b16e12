"""GGUF reading: names, q/k un-permutation, metadata -> config, and a tiny file end to end."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from asyncserve.config import ModelConfig
from asyncserve.models.gguf_loader import (
    GGUFFile,
    _hf_name,
    _unpermute,
    gguf_hf_config,
    open_gguf,
)
from asyncserve.models.loader import load_model
from tests.models.conftest import full_forward
from tests.models.tiny_gguf import TOKENS, llama_cpp_permute, write_tiny_gguf


@pytest.mark.parametrize("n_head", [1, 3, 4])
def test_unpermute_inverts_llama_cpp_permute(n_head: int) -> None:
    w = np.random.default_rng(0).standard_normal((n_head * 8, 5)).astype(np.float32)
    np.testing.assert_array_equal(_unpermute(llama_cpp_permute(w, n_head), n_head), w)
    bias = np.arange(n_head * 8, dtype=np.float32)
    np.testing.assert_array_equal(_unpermute(llama_cpp_permute(bias, n_head), n_head), bias)


def test_gguf_names_map_to_hf() -> None:
    assert _hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert _hf_name("output.weight") == "lm_head.weight"
    assert _hf_name("blk.12.attn_q.bias") == "model.layers.12.self_attn.q_proj.bias"
    assert _hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert _hf_name("blk.3.attn_k_norm.weight") == "model.layers.3.self_attn.k_norm.weight"
    # Gemma 3's ffn_norm is its pre-MLP norm; stacked experts come back one at a time.
    assert _hf_name("blk.1.ffn_norm.weight", "gemma3") == (
        "model.layers.1.pre_feedforward_layernorm.weight"
    )
    assert _hf_name("blk.1.ffn_norm.weight") == "model.layers.1.post_attention_layernorm.weight"
    assert _hf_name("blk.2.ffn_up_exps.weight", "qwen3moe") == (
        "model.layers.2.mlp.experts.{expert}.up_proj.weight"
    )
    assert _hf_name("blk.2.ffn_gate_inp.weight", "qwen3moe") == "model.layers.2.mlp.gate.weight"
    with pytest.raises(ValueError, match="blk.0.ssm_conv"):
        _hf_name("blk.0.ssm_conv.weight")


def test_smollm2_metadata_to_config(smollm2_gguf: GGUFFile) -> None:
    d = gguf_hf_config(smollm2_gguf)
    assert d["architectures"] == ["LlamaForCausalLM"]
    assert (d["num_hidden_layers"], d["hidden_size"], d["intermediate_size"]) == (30, 576, 1536)
    assert (d["num_attention_heads"], d["num_key_value_heads"]) == (9, 3)
    assert d["vocab_size"] == 49152 and d["tie_word_embeddings"] is True
    assert d["rope_theta"] == 100000.0 and d["max_position_embeddings"] == 8192
    assert (d["bos_token_id"], d["eos_token_id"]) == (1, 2)


def test_garbage_file_is_a_value_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="cannot read GGUF"):
        open_gguf(bad)


def _tiny_hf(arch: str) -> tuple[Any, dict[str, Any]]:
    transformers = pytest.importorskip("transformers")
    common: dict[str, Any] = dict(
        vocab_size=len(TOKENS),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        max_position_embeddings=256,
    )
    if arch == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    elif arch == "qwen3moe":
        config = transformers.Qwen3MoeConfig(
            **common,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
        )
        model = transformers.Qwen3MoeForCausalLM(config)
    elif arch == "gemma3":
        common["rope_theta"] = 1e6  # global layers; sliding ones keep HF's 1e4
        config = transformers.Gemma3TextConfig(
            **common,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=16,  # what llama.cpp uses: head_dim
        )
        model = transformers.Gemma3ForCausalLM(config)
    elif arch == "phi3":
        common["max_position_embeddings"] = 128  # twice the original: the long factors
        config = transformers.Phi3Config(
            **common,
            rope_parameters=PHI3_LONGROPE,
            original_max_position_embeddings=64,
            sliding_window=16,
            pad_token_id=None,
            bos_token_id=0,
            eos_token_id=1,
        )
        model = transformers.Phi3ForCausalLM(config)
    elif arch == "mixtral":
        config = transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
        model = transformers.MixtralForCausalLM(config)
    elif arch in ("granite", "granitemoe"):
        granite = {k: v for k, v in common.items() if k != "head_dim"}
        granite.update(GRANITE_SCALES)
        if arch == "granite":
            model = transformers.GraniteForCausalLM(transformers.GraniteConfig(**granite))
        else:
            granite.update(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)
            config = transformers.GraniteMoeConfig(**granite)
            model = transformers.GraniteMoeForCausalLM(config)
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.ndim == 1 else 0.0))
    return model.eval(), common


GRANITE_SCALES = dict(
    embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=2.0
)
# Partial rotary (8 of 16 dims) with LongRoPE, as Phi-3 128k checkpoints have.
PHI3_LONGROPE: dict[str, Any] = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.5,
    "short_factor": [1.0, 1.1, 1.2, 1.3],
    "long_factor": [2.0, 2.5, 3.0, 3.5],
    "original_max_position_embeddings": 64,
}
# GGUF arch written for each test family (llama.cpp converts Mixtral as llama).
GGUF_ARCH = {"mixtral": "llama"}


def _family_metadata(arch: str) -> Any:
    def add(w: Any) -> None:
        if arch in ("mixtral", "granitemoe"):
            w.add_expert_count(4)
            w.add_expert_used_count(2)
        if arch in ("granite", "granitemoe"):
            w.add_attention_scale(GRANITE_SCALES["attention_multiplier"])
            w.add_embedding_scale(GRANITE_SCALES["embedding_multiplier"])
            w.add_residual_scale(GRANITE_SCALES["residual_multiplier"])
            w.add_logit_scale(GRANITE_SCALES["logits_scaling"])
        if arch == "phi3":  # as convert_hf_to_gguf's Phi3MiniModel writes it
            w.add_rope_dimension_count(8)
            w.add_sliding_window(16)
            w.add_rope_scaling_orig_ctx_len(64)
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(128 / 64) / math.log(64)))
            for kind in ("short", "long"):
                factors = np.array(PHI3_LONGROPE[f"{kind}_factor"], dtype=np.float32)
                w.add_tensor(f"rope_factors_{kind}.weight", factors)
        if arch == "qwen3moe":
            w.add_expert_count(4)
            w.add_expert_used_count(2)
            w.add_expert_feed_forward_length(32)
        elif arch == "gemma3":
            w.add_sliding_window(8)
            w.add_sliding_window_pattern([True, False])

    return add


@pytest.mark.parametrize(
    "arch", ["llama", "qwen3", "qwen3moe", "gemma3", "mixtral", "granite", "granitemoe", "phi3"]
)
def test_tiny_gguf_loads_and_matches_hf(arch: str, tmp_path: Path) -> None:
    hf, cfg = _tiny_hf(arch)
    state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    path = tmp_path / "tiny.gguf"
    moe_ff = {"mixtral": 96, "granitemoe": 32, "phi3": 96}.get(arch)
    write_tiny_gguf(
        path,
        GGUF_ARCH.get(arch, arch),
        state,
        heads=cfg["num_attention_heads"],
        kv_heads=cfg["num_key_value_heads"],
        head_dim=cfg["head_dim"],
        rope_theta=cfg["rope_theta"],
        eps=cfg["rms_norm_eps"],
        extra=_family_metadata(arch),
        feed_forward_length=moe_ff,
        context=cfg["max_position_embeddings"],
    )
    # A directory holding exactly one .gguf loads that file.
    loaded = load_model(ModelConfig(model=str(tmp_path), dtype="float32"), torch.device("cpu"))
    assert loaded.arch.qk_norm == (arch in ("qwen3", "qwen3moe", "gemma3"))
    assert loaded.arch.architecture == type(hf).__name__
    assert loaded.arch.tie_word_embeddings
    assert loaded.model_path == str(path)
    # Longer than Gemma's window of 8.
    ids = [0, *torch.randint(2, len(TOKENS), (20,), generator=torch.Generator().manual_seed(3))]
    ours = full_forward(loaded.model, [int(i) for i in ids])
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    # The tokenizer comes from the same file: control tokens, merges, bos added.
    tok = loaded.tokenizer
    assert tok.add_bos_token and tok.bos_token == "<s>" and tok.eos_token_id == 1
    assert tok.encode("the") == [0, TOKENS.index("t"), TOKENS.index("he")]
    assert tok.encode(" t</s>", add_special_tokens=False) == [TOKENS.index("Ġt"), 1]
    assert loaded.generation_config["eos_token_id"] == [1]


def test_truncated_gguf_is_a_one_line_value_error(tmp_path: Path) -> None:
    hf, cfg = _tiny_hf("llama")
    state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    path = tmp_path / "whole.gguf"
    write_tiny_gguf(path, "llama", state, heads=4, kv_heads=2, head_dim=16, rope_theta=1e4,
                    eps=1e-5)  # fmt: skip
    whole = path.read_bytes()
    # Cut in the header, the metadata, the tensor infos, the tensor data, and one byte short.
    for size in (0, 10, 24, 100, 6000, len(whole) // 2, len(whole) - 1):
        cut = tmp_path / f"cut{size}.gguf"
        cut.write_bytes(whole[:size])
        with pytest.raises(ValueError) as caught:
            load_model(ModelConfig(model=str(cut), dtype="float32"), torch.device("cpu"))
        message = str(caught.value)
        assert str(cut) in message and "truncated or corrupt" in message, message
        assert "\n" not in message, message
