"""EAGLE heads on a tiny random Llama target: greedy output equals decoding without
speculation, a pass-through head proposes what the target's hidden states say, and bad
heads fail at start."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from asyncserve.llm import LLM
from asyncserve.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")

CONFIG = dict(
    vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    tie_word_embeddings=False,
)  # fmt: skip
PROMPTS = [{"prompt_token_ids": [1, 5 + i, 40, 41 + i, 7, 9, 11]} for i in range(3)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("eagle-target")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).float()
    model.save_pretrained(path, safe_serialization=True)
    return path


def _save_head(
    path: Path, edit: Callable[[dict[str, torch.Tensor]], None] | None = None, **overrides: int
) -> str:
    """A random EAGLE-1 head with the published tensor names (no embed_tokens, no
    input_layernorm in layer 0)."""
    from safetensors.torch import save_file

    config = transformers.LlamaConfig(**{**CONFIG, "num_hidden_layers": 1, **overrides})
    layer = transformers.models.llama.modeling_llama.LlamaDecoderLayer(config, 0)
    hidden = config.hidden_size
    tensors = {"fc.weight": torch.randn(hidden, 2 * hidden) / (2 * hidden) ** 0.5}
    for name, tensor in layer.state_dict().items():
        if not name.startswith("input_layernorm."):
            tensors[f"layers.0.{name}"] = tensor.float().contiguous()
    if edit is not None:
        edit(tensors)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config.to_dict()))
    return str(path)


def _llm(model: Path, speculative_config: dict[str, object] | None) -> LLM:
    return LLM(
        str(model),
        device="cpu",
        dtype="float32",
        max_model_len=128,
        kv_cache_memory=8 << 20,
        speculative_config=speculative_config,
    )


def _generate(llm: LLM) -> list[list[int]]:
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_greedy_output_equals_no_speculation(target: Path, tmp_path: Path) -> None:
    torch.manual_seed(1)
    head = _save_head(tmp_path / "head")
    plain = _llm(target, None)
    try:
        expected = _generate(plain)
    finally:
        plain.close()
    llm = _llm(target, {"method": "eagle", "model": head, "num_speculative_tokens": 3})
    try:
        assert _generate(llm) == expected
        assert llm.engine.scheduler.spec_stats.num_draft_tokens > 0
    finally:
        llm.close()


def test_pass_through_head_proposes_from_the_target_hidden_states(
    target: Path, tmp_path: Path
) -> None:
    """fc = [0 | I] and a layer that adds nothing: the head's output is the target's hidden
    state at the last position, whose logits gave the last token, so every proposal repeats
    the request's last token. Wrong hidden rows or positions would propose other tokens."""

    def pass_through(tensors: dict[str, torch.Tensor]) -> None:
        hidden = CONFIG["hidden_size"]
        tensors["fc.weight"] = torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], 1)
        tensors["layers.0.self_attn.o_proj.weight"].zero_()
        tensors["layers.0.mlp.down_proj.weight"].zero_()

    head = _save_head(tmp_path / "head", pass_through)
    llm = _llm(target, {"method": "eagle", "model": head, "num_speculative_tokens": 2})
    try:
        runner = llm.engine.runner
        assert runner is not None and runner.proposer is not None
        propose = runner.proposer.propose
        seen: list[tuple[int, list[int]]] = []

        def observed(states: list) -> dict[str, list[int]]:  # type: ignore[type-arg]
            out = propose(states)
            seen.extend((s.output_token_ids[-1], out[s.request_id]) for s in states)
            return out

        runner.proposer.propose = observed  # type: ignore[method-assign]
        _generate(llm)
    finally:
        llm.close()
    assert len(seen) > len(PROMPTS)
    assert all(drafts == [last, last] for last, drafts in seen), seen


def test_eagle_needs_a_model() -> None:
    with pytest.raises(ValueError, match="method 'eagle' needs a model"):
        LLM(device="cpu", speculative_config={"method": "eagle", "num_speculative_tokens": 2})


def test_head_hidden_size_must_match(target: Path, tmp_path: Path) -> None:
    head = _save_head(tmp_path / "head", hidden_size=32, intermediate_size=64)
    with pytest.raises(ValueError, match=r"EAGLE head's hidden_size \(32\) differs"):
        _llm(target, {"method": "eagle", "model": head, "num_speculative_tokens": 2})
