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


@pytest.fixture(scope="module")
def repeating_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tied embeddings: greedy decoding repeats the last token, which a head that passes
    the hidden state through (plus noise) proposes often but not always."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("eagle-repeating-target")
    config = transformers.LlamaConfig(**{**CONFIG, "tie_word_embeddings": True})
    transformers.LlamaForCausalLM(config).float().save_pretrained(path, safe_serialization=True)
    return path


def _noisy_pass_through(tensors: dict[str, torch.Tensor]) -> None:
    """fc = [noise | I] and a strong random layer: proposals depend on the head's K/V and
    some of them are accepted on the repeating target."""
    hidden = CONFIG["hidden_size"]
    noise = torch.randn(hidden, hidden) / 8
    tensors["fc.weight"] = torch.cat([noise, torch.eye(hidden)], dim=1)
    tensors["layers.0.self_attn.o_proj.weight"].mul_(5.0)
    tensors["layers.0.mlp.down_proj.weight"].mul_(5.0)


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


@pytest.mark.parametrize("noisy", [False, True], ids=["random-head", "noisy-pass-through"])
def test_greedy_output_equals_no_speculation(
    target: Path, repeating_target: Path, tmp_path: Path, noisy: bool
) -> None:
    torch.manual_seed(1)
    head = _save_head(tmp_path / "head", _noisy_pass_through if noisy else None)
    if noisy:
        target = repeating_target
    plain = _llm(target, None)
    try:
        expected = _generate(plain)
    finally:
        plain.close()
    llm = _llm(target, {"method": "eagle", "model": head, "num_speculative_tokens": 3})
    try:
        assert _generate(llm) == expected
        stats = llm.engine.scheduler.spec_stats
        assert stats.num_draft_tokens > 0
        if noisy:
            assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
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


def _eagle_reference(
    target: object, layer: object, fc: torch.Tensor, tokens: list[int], k: int
) -> list[int]:
    """EAGLE-1's greedy proposals after `tokens`, recomputed from scratch with transformers:
    position p takes [embedding of token p + 1, target hidden state at p]; each proposal
    feeds its token and the head's output hidden state to the next position."""
    model = target.model  # type: ignore[attr-defined]
    embed = model.embed_tokens.weight
    xs = embed[tokens[1:]]
    hs = model(torch.tensor([tokens])).last_hidden_state[0, :-1]
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(target.config)  # type: ignore[attr-defined]
    drafts: list[int] = []
    for _ in range(k):
        x = (torch.cat([xs, hs], dim=-1) @ fc.T)[None]
        positions = torch.arange(x.shape[1])[None]
        mask = torch.full((x.shape[1],) * 2, float("-inf")).triu(1)[None, None]
        out = layer(  # type: ignore[operator]
            x, attention_mask=mask, position_ids=positions,
            position_embeddings=rotary(x, positions),
        )  # fmt: skip
        last = (out[0] if isinstance(out, tuple) else out)[0, -1]
        token = int((target.lm_head.weight @ last).argmax())  # type: ignore[attr-defined]
        drafts.append(token)
        xs = torch.cat([xs, embed[token][None]])
        hs = torch.cat([hs, last[None]])
    return drafts


@torch.no_grad()
def test_proposals_equal_an_eagle_reference(repeating_target: Path, tmp_path: Path) -> None:
    """Every proposal round (prompts prefilled in chunks, some proposals accepted, the
    second pass reading the head's K/V of prefix-cached blocks) proposes what EAGLE
    computed from scratch proposes."""
    torch.manual_seed(2)
    target = repeating_target
    head = _save_head(tmp_path / "head", _noisy_pass_through)
    from safetensors.torch import load_file

    tensors = load_file(str(Path(head) / "model.safetensors"))
    config = transformers.LlamaConfig(**{**CONFIG, "num_hidden_layers": 1})
    config._attn_implementation = "eager"
    layer = transformers.models.llama.modeling_llama.LlamaDecoderLayer(config, 0).float()
    layer.load_state_dict(
        {n.removeprefix("layers.0."): t for n, t in tensors.items() if n.startswith("layers.")},
        strict=False,
    )
    layer.input_layernorm = torch.nn.Identity()
    hf_target = transformers.LlamaForCausalLM.from_pretrained(target).float().eval()
    prompts = [{"prompt_token_ids": [1, *range(20 + i, 41 + i)]} for i in range(2)]
    llm = LLM(
        str(target), device="cpu", dtype="float32", max_model_len=128,
        kv_cache_memory=8 << 20, max_num_batched_tokens=16,
        speculative_config={"method": "eagle", "model": head, "num_speculative_tokens": 3},
    )  # fmt: skip
    try:
        runner = llm.engine.runner
        assert runner is not None and runner.proposer is not None
        propose = runner.proposer.propose
        seen: list[tuple[list[int], list[int]]] = []

        def observed(states: list) -> dict[str, list[int]]:  # type: ignore[type-arg]
            out = propose(states)
            seen.extend(
                (s.prompt_token_ids + s.output_token_ids, out[s.request_id]) for s in states
            )
            return out

        runner.proposer.propose = observed  # type: ignore[method-assign]
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        first = llm.generate(prompts, params, use_tqdm=False)
        second = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.scheduler.kv_cache_manager.prefix_cache_hits > 0
        stats = llm.engine.scheduler.spec_stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    finally:
        llm.close()
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]
    assert len(seen) > 2 * len(prompts)
    for tokens, drafts in seen:
        assert drafts == _eagle_reference(hf_target, layer, tensors["fc.weight"], tokens, 3)


def test_eagle_config_holds_lookahead_slots() -> None:
    from asyncserve.spec_decode.config import SpeculativeConfig

    spec = SpeculativeConfig.from_value(
        '{"method": "eagle", "model": "/heads/eagle", "num_speculative_tokens": 4}'
    )
    assert (spec.method, spec.model, spec.num_lookahead_tokens) == ("eagle", "/heads/eagle", 4)


def test_eagle_needs_a_model() -> None:
    with pytest.raises(ValueError, match="method 'eagle' needs a model"):
        LLM(device="cpu", speculative_config={"method": "eagle", "num_speculative_tokens": 2})


def test_eagle_needs_one_rank() -> None:
    from asyncserve.config import EngineConfig

    with pytest.raises(ValueError, match="an EAGLE head needs tensor_parallel_size 1"):
        EngineConfig.from_engine_args(
            tensor_parallel_size=2,
            speculative_config={"method": "eagle", "model": "/h", "num_speculative_tokens": 2},
        )


def test_eagle_needs_a_llama_family_target(tmp_path: Path) -> None:
    config = transformers.OPTConfig(
        vocab_size=320, hidden_size=64, ffn_dim=128, num_hidden_layers=1,
        num_attention_heads=4, max_position_embeddings=256, word_embed_proj_dim=64,
    )  # fmt: skip
    transformers.OPTForCausalLM(config).save_pretrained(tmp_path / "opt", safe_serialization=True)
    head = _save_head(tmp_path / "head")
    with pytest.raises(ValueError, match="needs a Llama-family target, got OPTForCausalLM"):
        _llm(tmp_path / "opt", {"method": "eagle", "model": head, "num_speculative_tokens": 2})


def test_head_hidden_size_must_match(target: Path, tmp_path: Path) -> None:
    head = _save_head(tmp_path / "head", hidden_size=32, intermediate_size=64)
    with pytest.raises(ValueError, match=r"EAGLE head's hidden_size \(32\) differs"):
        _llm(target, {"method": "eagle", "model": head, "num_speculative_tokens": 2})
