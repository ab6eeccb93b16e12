"""ArchConfig.from_hf_dict across Llama, Mistral, Qwen2, Qwen3 and config layouts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from asyncserve.models.arch_config import ArchConfig

BENCH = Path("/work/shared/bench")


def base(**overrides: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 1000,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 512,
    }
    d.update(overrides)
    return d


def test_defaults_fill_head_dim_kv_heads_and_rope() -> None:
    c = ArchConfig.from_hf_dict(base(eos_token_id=2, bos_token_id=1))
    assert c.head_dim == 16 and c.num_key_value_heads == 4
    assert c.rope_theta == 10000.0 and c.rope_scaling is None
    assert c.eos_token_ids == [2] and c.bos_token_id == 1
    assert not c.attention_bias and not c.qk_norm and not c.tie_word_embeddings
    assert c.q_size == 64 and c.kv_size == 64


@pytest.mark.skipif(not (BENCH / "llama3-8b").is_dir(), reason="bench configs absent")
def test_bench_configs() -> None:
    llama = ArchConfig.from_hf_dict(json.loads((BENCH / "llama3-8b/config.json").read_text()))
    assert llama.eos_token_ids == [128001, 128008, 128009]
    assert llama.rope_scaling is not None and llama.rope_scaling["rope_type"] == "llama3"
    assert llama.torch_dtype == "bfloat16" and llama.num_key_value_heads == 8
    qwen = ArchConfig.from_hf_dict(json.loads((BENCH / "qwen3-0.6b/config.json").read_text()))
    assert qwen.qk_norm and qwen.tie_word_embeddings and qwen.head_dim == 128
    assert qwen.eos_token_ids == [151645]


def test_qwen2_always_has_qkv_bias() -> None:
    c = ArchConfig.from_hf_dict(base(architectures=["Qwen2ForCausalLM"], model_type="qwen2"))
    assert c.attention_bias and not c.qk_norm


def test_new_transformers_layout_rope_parameters_and_dtype() -> None:
    d = base(
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5},
        dtype="float16",
    )
    c = ArchConfig.from_hf_dict(d)
    assert c.rope_theta == 5e5
    assert c.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert c.torch_dtype == "float16"
    default = ArchConfig.from_hf_dict(base(rope_parameters={"rope_type": "default"}))
    assert default.rope_scaling is None


def test_old_rope_scaling_type_key() -> None:
    c = ArchConfig.from_hf_dict(base(rope_scaling={"type": "linear", "factor": 4.0}))
    assert c.rope_scaling == {"rope_type": "linear", "factor": 4.0}


def test_mistral_sliding_window_applies_in_attention() -> None:
    mistral = base(architectures=["MistralForCausalLM"], model_type="mistral")
    assert ArchConfig.from_hf_dict({**mistral, "sliding_window": None}).sliding_window is None
    windowed = ArchConfig.from_hf_dict({**mistral, "sliding_window": 128})
    assert windowed.max_position_embeddings == 512
    assert windowed.layer_window(0) == windowed.layer_window(1) == 128
    # Every layer is windowed: the KV cache may drop blocks behind the window.
    assert windowed.kv_sliding_window == 128
    assert ArchConfig.from_hf_dict(mistral).kv_sliding_window is None


def test_qwen2_sliding_window_caps_the_context() -> None:
    # Qwen2 windows only some layers; not applied per layer, so the context stops at it.
    qwen2 = base(architectures=["Qwen2ForCausalLM"], model_type="qwen2", sliding_window=128)
    c = ArchConfig.from_hf_dict({**qwen2, "use_sliding_window": True})
    assert c.max_position_embeddings == 128 and c.sliding_window is None
    assert ArchConfig.from_hf_dict(qwen2).max_position_embeddings == 128
    off = ArchConfig.from_hf_dict({**qwen2, "use_sliding_window": False})
    assert off.max_position_embeddings == 512


def test_architecture_from_model_type_when_unlisted() -> None:
    d = base(model_type="qwen3")
    del d["architectures"]
    assert ArchConfig.from_hf_dict(d).architecture == "Qwen3ForCausalLM"


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel.*LlamaForCausalLM"),
        ({"hidden_size": None}, "hidden_size"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"eos_token_id": "x"}, "eos_token_id"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"hidden_size": 66}, "head_dim"),
        ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0"),
        ({"num_key_value_heads": "2"}, "num_key_value_heads must be an integer"),
        ({"rms_norm_eps": "x"}, "rms_norm_eps must be a number, got 'x'"),
        ({"rope_theta": "abc"}, "rope_theta must be a number"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, "factor must be > 0"),
        ({"rope_scaling": {"rope_type": "linear", "factor": "x"}}, "factor must be a number"),
        ({"sliding_window": 0}, "sliding_window must be >= 1, got 0"),
        ({"partial_rotary_factor": "half"}, "partial_rotary_factor must be a number"),
    ],
)
def test_bad_configs_raise_naming_the_field(overrides: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ArchConfig.from_hf_dict(base(**overrides))


def test_gemma3_hub_layout() -> None:
    """An older Gemma 3 config: window pattern instead of layer_types, local rope base,
    linear scaling for the global layers, head tied by default."""
    c = ArchConfig.from_hf_dict(
        base(
            architectures=["Gemma3ForCausalLM"],
            model_type="gemma3_text",
            num_hidden_layers=6,
            head_dim=32,
            sliding_window=512,
            sliding_window_pattern=3,
            rope_theta=1e6,
            rope_local_base_freq=1e4,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
            query_pre_attn_scalar=256,
            hidden_activation="gelu_pytorch_tanh",
        )
    )
    assert [c.layer_window(i) for i in range(6)] == [512, 512, None, 512, 512, None]
    # The global layers read every block: none may leave the cache early.
    assert c.kv_sliding_window is None
    assert c.rope_theta == 1e6 and c.rope_local_theta == 1e4
    assert c.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert c.attention_scale == 256**-0.5 and c.qk_norm and c.tie_word_embeddings
    assert c.max_position_embeddings == 512  # the window no longer caps the context


def test_qwen3_moe_hub_layout() -> None:
    c = ArchConfig.from_hf_dict(
        base(
            architectures=["Qwen3MoeForCausalLM"],
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
            norm_topk_prob=True,
            decoder_sparse_step=2,
            mlp_only_layers=[3],
            num_hidden_layers=6,
        )
    )
    assert c.moe is not None and c.moe.renormalize and c.moe.num_experts == 128
    assert [c.moe.is_sparse(i) for i in range(6)] == [False, True, False, False, False, True]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"architectures": ["OPTForCausalLM"], "ffn_dim": 32, "enable_bias": False}, "OPT"),
        (
            {"architectures": ["OPTForCausalLM"], "ffn_dim": 32, "activation_function": "gelu"},
            "gelu",
        ),
        ({"architectures": ["Gemma3ForCausalLM"], "use_bidirectional_attention": True}, "bidir"),
        ({"architectures": ["Gemma3ForCausalLM"], "hidden_activation": "silu"}, "silu"),
        ({"architectures": ["MixtralForCausalLM"]}, "num_local_experts"),
        ({"architectures": ["Phi3ForCausalLM"], "rope_scaling": {"type": "yarn"}}, "yarn"),
        ({"architectures": ["Phi3ForCausalLM"], "rope_scaling": {"type": "su"}}, "original_max"),
    ],
)
def test_unsupported_family_options_raise_one_line(overrides: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        ArchConfig.from_hf_dict(base(**overrides))
    assert "\n" not in str(info.value)
