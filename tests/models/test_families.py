"""Every non-Llama family equals HF transformers: tiny random configs saved as safetensors,
loaded by asyncserve, greedy 24 tokens for a batch of 4 prompts under chunked prefill (fp32,
CPU), and the prefill logits of one prompt."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncserve import SamplingParams
from asyncserve.config import ModelConfig
from asyncserve.llm import LLM
from asyncserve.models.loader import load_model
from tests.models.conftest import full_forward

transformers = pytest.importorskip("transformers")

VOCAB = 320  # the byte-level placeholder tokenizer needs 256 + specials
NUM_TOKENS = 24
# Prompt lengths around the chunk size and the Gemma / Phi-3 windows (8 and 16).
PROMPT_LENS = (5, 13, 21, 30)
CHUNK = 16  # max_num_batched_tokens: longer prompts prefill in several steps

COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
GRANITE_MULTIPLIERS: dict[str, Any] = dict(
    embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=2.0
)


def _longrope(rotary_dim: int) -> dict[str, Any]:
    half = rotary_dim // 2
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "short_factor": [1.0 + 0.1 * i for i in range(half)],
        "long_factor": [2.0 + 0.5 * i for i in range(half)],
        # Past it HF recomputes every key with the long factors (see layers._longrope_cache);
        # both tests stay inside it, test_layers checks the long half of the table.
        "original_max_position_embeddings": 64,
    }


def _hf_config(name: str) -> Any:
    t = transformers
    if name == "mixtral":
        return t.MixtralConfig(
            **COMMON, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2
        )
    if name == "qwen3_moe":
        return t.Qwen3MoeConfig(
            **COMMON,
            head_dim=32,
            intermediate_size=96,
            moe_intermediate_size=48,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            mlp_only_layers=[1],  # one dense layer
        )
    if name == "granite":
        return t.GraniteConfig(**COMMON, intermediate_size=96, **GRANITE_MULTIPLIERS)
    if name == "granitemoe":
        return t.GraniteMoeConfig(
            **COMMON,
            intermediate_size=48,
            num_local_experts=4,
            num_experts_per_tok=2,
            **GRANITE_MULTIPLIERS,
        )
    if name == "phi3":
        return t.Phi3Config(
            **{**COMMON, "pad_token_id": None},
            intermediate_size=96,
            rope_parameters=_longrope(8),
            original_max_position_embeddings=64,
            sliding_window=16,
        )
    if name == "gemma3":
        return t.Gemma3TextConfig(
            **COMMON,
            head_dim=16,
            intermediate_size=96,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            rope_scaling={"rope_type": "linear", "factor": 2.0},
            query_pre_attn_scalar=24,
            attn_logit_softcapping=8.0,  # HF's Gemma 3 ignores it; so must we
            final_logit_softcapping=30.0,
        )
    if name in ("opt", "opt_post_norm"):
        pre_norm = name == "opt"
        return t.OPTConfig(
            **{k: v for k, v in COMMON.items() if k != "num_key_value_heads"},
            ffn_dim=96,
            do_layer_norm_before=pre_norm,
            word_embed_proj_dim=32 if pre_norm else 64,  # project_in / project_out
        )
    raise AssertionError(name)


_MODEL_CLASSES = {
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "granite": "GraniteForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "opt": "OPTForCausalLM",
    "opt_post_norm": "OPTForCausalLM",
}


def save_tiny_family(name: str, path: Path) -> Any:
    """A tiny random HF model of the family saved as safetensors in `path`; returns it."""
    torch.manual_seed(0)
    hf = getattr(transformers, _MODEL_CLASSES[name])(_hf_config(name)).float().eval()
    with torch.no_grad():  # every weight random, norms and biases included
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.ndim == 1 else 0.0))
    hf.save_pretrained(path, safe_serialization=True)
    return hf


@dataclass
class Family:
    name: str
    path: Path
    hf: Any
    prompts: list[list[int]]


@pytest.fixture(scope="module", params=list(_MODEL_CLASSES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    name = request.param
    path = tmp_path_factory.mktemp(name)
    hf = save_tiny_family(name, path)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    return Family(name, path, hf, prompts)


def _hf_greedy(hf: Any, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NUM_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def test_prefill_logits_match_hf(family: Family) -> None:
    loaded = load_model(ModelConfig(model=str(family.path), dtype="float32"), torch.device("cpu"))
    assert loaded.arch.architecture == _MODEL_CLASSES[family.name]
    ids = family.prompts[-1]
    ours = full_forward(loaded.model, ids)
    with torch.no_grad():
        theirs = family.hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["gemma3", "qwen3_moe", "phi3"])
def test_prefill_logits_with_the_gpu_kernels_match_hf(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU kernel set (Triton's interpreter here) on whole models: per-head q/k norms on
    views of the fused qkv rows and rotary fused with the KV store (Phi-3: partial rotary),
    Gemma's GELU-and-multiply, the fused MoE."""
    pytest.importorskip("triton", reason="triton is not installed")
    from asyncserve.kernels.ops import REFERENCE_OPS
    from asyncserve.kernels.triton_ops import TRITON_OPS
    from asyncserve.models import loader

    hf = save_tiny_family(name, tmp_path)
    ids = torch.randint(3, VOCAB, (21,), generator=torch.Generator().manual_seed(1)).tolist()
    monkeypatch.setattr(loader, "select_ops", lambda device: TRITON_OPS)
    loaded = load_model(ModelConfig(model=str(tmp_path), dtype="float32"), torch.device("cpu"))
    kernel_sets = [getattr(module, "ops", None) for module in loaded.model.modules()]
    assert TRITON_OPS in kernel_sets and REFERENCE_OPS not in kernel_sets
    ours = full_forward(loaded.model, ids)
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_greedy_batch_with_chunked_prefill_matches_hf(family: Family) -> None:
    llm = LLM(
        str(family.path),
        device="cpu",
        dtype="float32",
        block_size=4,
        max_num_batched_tokens=CHUNK,
        kv_cache_memory=8 << 20,
        enforce_eager=True,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
        outputs = llm.generate(family.prompts, params, use_tqdm=False)
    finally:
        llm.close()
    for prompt, output in zip(family.prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == _hf_greedy(family.hf, prompt), len(prompt)
