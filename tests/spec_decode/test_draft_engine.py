"""Draft-model speculative decoding on SmolLM2: itself and a 2-layer truncation as drafts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncserve.llm import LLM
from asyncserve.models.arch_config import ArchConfig
from asyncserve.models.gguf_loader import gguf_hf_config, iter_gguf_weights, open_gguf
from asyncserve.sampling_params import SamplingParams
from tests.conftest import PLAIN_PROMPTS
from tests.spec_decode.test_ngram_engine import COUNTING

PROMPTS = [*PLAIN_PROMPTS[:2], COUNTING]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


@pytest.fixture(scope="module")
def truncated_draft(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's first two layers (with its embeddings, final norm and head) as a
    safetensors folder: a cheap draft that agrees with it less often."""
    from safetensors.torch import save_file

    gguf = open_gguf(gguf_path)
    config = gguf_hf_config(gguf)
    arch = ArchConfig.from_hf_dict(config)
    tensors = {
        name: tensor.float().contiguous()
        for name, tensor in iter_gguf_weights(gguf, arch)
        if ".layers." not in name or name.split(".layers.")[1].split(".")[0] in ("0", "1")
    }
    path = tmp_path_factory.mktemp("smollm2-2layers")
    save_file(tensors, str(path / "model.safetensors"))
    config.update(num_hidden_layers=2, torch_dtype="float32")
    (path / "config.json").write_text(json.dumps(config))
    return path


def _run(draft: str, *runs: SamplingParams) -> list[tuple[list[list[int]], float]]:
    """Each run's token ids and acceptance rate, on one engine with `draft`."""
    llm = LLM(
        device="cpu",
        max_model_len=160,  # 16 MiB hold 176 tokens of target and draft K/V
        kv_cache_memory=16 << 20,
        speculative_config={"model": draft, "num_speculative_tokens": 3},
    )
    try:
        results = []
        for params in runs:
            stats = llm.engine.scheduler.spec_stats
            drafts, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
            outputs = llm.generate(PROMPTS, params, use_tqdm=False)
            assert stats.num_draft_tokens > drafts
            rate = (stats.num_accepted_tokens - accepted) / (stats.num_draft_tokens - drafts)
            results.append(([list(o.outputs[0].token_ids) for o in outputs], rate))
        return results
    finally:
        llm.close()


def _reference(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_the_model_as_its_own_draft(gguf_path: Path, smollm2_llm: LLM) -> None:
    """Greedy: the same tokens, every proposal accepted. Sampled: with q = p every proposal
    is accepted too, so the draft's distribution reaches the rejection sampler processed
    exactly as the target's (temperature, top-k, top-p)."""
    sampled = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, max_tokens=8, seed=5)
    (ours, greedy_rate), (_, sampled_rate) = _run(str(gguf_path), GREEDY, sampled)
    assert ours == _reference(smollm2_llm)
    assert greedy_rate > 0.95, greedy_rate
    assert sampled_rate > 0.95, sampled_rate


def test_a_truncated_draft_keeps_greedy_output(truncated_draft: Path, smollm2_llm: LLM) -> None:
    [(ours, acceptance)] = _run(str(truncated_draft), GREEDY)
    assert ours == _reference(smollm2_llm)
    assert acceptance < 0.95, acceptance


def test_draft_vocabulary_must_match(tmp_path: Path) -> None:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path, safe_serialization=True)
    with pytest.raises(ValueError, match=r"draft model's vocabulary \(320 tokens\) differs"):
        LLM(
            device="cpu",
            max_model_len=128,
            kv_cache_memory=4 << 20,
            speculative_config={"model": str(tmp_path), "num_speculative_tokens": 2},
        )
