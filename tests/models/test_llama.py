"""The Llama-family model equals HF transformers: SmolLM2 from its GGUF, and tiny random
Qwen2 / Qwen3 / Mistral / Llama-3 configs through the safetensors loader."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncserve.config import ModelConfig
from asyncserve.models.loader import LoadedModel, load_model
from tests.conftest import PLAIN_PROMPTS
from tests.models.conftest import full_forward, new_kv_caches, paged_step

CHAT_PROMPT = (
    "<|im_start|>user\nWhat is 17 * 23? Answer briefly.<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.mark.parametrize("prompt", [PLAIN_PROMPTS[0], PLAIN_PROMPTS[5], CHAT_PROMPT])
def test_smollm2_prefill_matches_hf(smollm2: LoadedModel, hf_smollm2: Any, prompt: str) -> None:
    hf_model, _ = hf_smollm2
    ids = smollm2.tokenizer.encode(prompt)
    ours = full_forward(smollm2.model, ids)
    with torch.no_grad():
        theirs = hf_model(torch.tensor([ids])).logits[0].float()
    last_diff = (ours[-1].log_softmax(-1) - theirs[-1].log_softmax(-1)).abs().max().item()
    assert last_diff < 1e-3
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_smollm2_paged_batch_steps_match_full_forward(smollm2: LoadedModel) -> None:
    """Two sequences prefilled together (one in two chunks), then decoded together through a
    shuffled, non-contiguous block table, give the logits of a plain full forward."""
    model, tok = smollm2.model, smollm2.tokenizer
    a = tok.encode(PLAIN_PROMPTS[2])
    b = tok.encode(CHAT_PROMPT)
    blocks = list(range(32))
    random.Random(0).shuffle(blocks)
    table_a, table_b = blocks[:8], blocks[8:24]
    caches = new_kv_caches(model, num_blocks=32)
    # Step 1: a's prompt except its last token, and the first 7 tokens of b.
    paged_step(model, caches, [(a[:-1], 0, table_a), (b[:7], 0, table_b)])
    # Step 2: a decodes its last prompt token while b finishes its prefill chunk.
    step2 = paged_step(model, caches, [(a, len(a) - 1, table_a), (b[:-1], 7, table_b)])
    # Step 3: b decodes alone.
    step3 = paged_step(model, caches, [(b, len(b) - 1, table_b)])
    full_a, full_b = full_forward(model, a), full_forward(model, b)
    torch.testing.assert_close(step2[0], full_a[-1:], atol=1e-4, rtol=0)
    torch.testing.assert_close(step2[1], full_b[7:-1], atol=1e-4, rtol=0)
    torch.testing.assert_close(step3[0], full_b[-1:], atol=1e-4, rtol=0)


def test_smollm2_loaded_shape(smollm2: LoadedModel) -> None:
    arch = smollm2.arch
    assert (arch.num_hidden_layers, arch.hidden_size, arch.head_dim) == (30, 576, 64)
    assert (arch.num_attention_heads, arch.num_key_value_heads) == (9, 3)
    assert arch.tie_word_embeddings
    assert smollm2.model.lm_head.weight is smollm2.model.model.embed_tokens.weight
    assert smollm2.dtype == torch.float32
    assert smollm2.generation_config["eos_token_id"] == [2]


# --- tiny random models against HF's own implementations ----------------------------------

TINY: dict[str, Any] = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)


def _hf_tiny(name: str) -> Any:
    transformers = pytest.importorskip("transformers")
    if name == "qwen2":
        return transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config(**TINY, rope_theta=10000.0, tie_word_embeddings=True)
        )
    if name == "qwen3":
        return transformers.Qwen3ForCausalLM(
            transformers.Qwen3Config(**TINY, head_dim=32, rope_theta=1e6)
        )
    if name == "mistral":
        return transformers.MistralForCausalLM(
            transformers.MistralConfig(**TINY, sliding_window=None, rope_theta=1e4)
        )
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**TINY, rope_theta=5e5, rope_scaling=scaling)
    )


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "mistral", "llama3"])
def test_tiny_model_matches_hf(name: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    hf = _hf_tiny(name).float().eval()
    with torch.no_grad():  # every weight random, norms and biases included
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.ndim == 1 else 0.0))
    hf.save_pretrained(tmp_path)
    loaded = load_model(ModelConfig(model=str(tmp_path), dtype="float32"), torch.device("cpu"))
    arch = loaded.arch
    assert arch.attention_bias == (name == "qwen2")
    assert arch.qk_norm == (name == "qwen3")
    # Long enough for llama3 scaling to matter (original context 16).
    ids = torch.randint(0, TINY["vocab_size"], (40,), generator=torch.Generator().manual_seed(1))
    ours = full_forward(loaded.model, ids.tolist())
    with torch.no_grad():
        theirs = hf(ids[None]).logits[0].float()
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def test_forward_rejects_wrong_number_of_caches(smollm2: LoadedModel) -> None:
    caches = new_kv_caches(smollm2.model, 1)[:3]
    with pytest.raises(ValueError, match="kv_caches"):
        paged_step(smollm2.model, caches, [([1, 2], 0, [0])])
