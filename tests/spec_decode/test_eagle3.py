"""EAGLE-3 heads (published layout) on a tiny random Llama target: greedy output equals
decoding without speculation, proposals equal a from-scratch recomputation of the head
(through its d2t draft vocabulary), and bad heads fail at start with one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from asyncserve.llm import LLM
from asyncserve.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")

HIDDEN = 64
VOCAB = 320
# Seven layers: vLLM's default auxiliary layers (2, L // 2, L - 3) are 2, 3 and 4.
CONFIG = dict(
    vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=7,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    tie_word_embeddings=True,
)  # fmt: skip
AUX_LAYERS = (2, 3, 4)
PROMPTS = [{"prompt_token_ids": [1, 5 + i, 40, 41 + i, 7, 9, 11]} for i in range(3)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tied embeddings: greedy decoding mostly repeats the last token, which a head that
    reads the embedding part of the residual stream can propose."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("eagle3-target")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).float()
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def expected(target: Path) -> list[list[int]]:
    llm = _llm(target, None)
    try:
        outputs = _generate(llm)
        # Without an EAGLE-3 head the target keeps no auxiliary hidden states.
        assert llm.engine.runner is not None
        model = llm.engine.runner.model.model
        assert not model.aux_hidden_state_layers and not model.aux_hidden_states
        return outputs
    finally:
        llm.close()


def _head_tensors(
    target: Path, seed: int, draft_ids: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """A random EAGLE-3 head with the published tensor names. fc reads mostly the lowest
    auxiliary layer (close to the token's embedding) and lm_head is the target's embedding
    over the draft vocabulary, so some proposals are accepted."""
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(seed)
    embed = load_file(str(target / "model.safetensors"))["model.embed_tokens.weight"]
    ids = torch.arange(VOCAB) if draft_ids is None else draft_ids
    heads, kv_heads, head_dim = 4, 2, HIDDEN // 4

    def randn(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    def norm() -> torch.Tensor:
        return 1.0 + randn(HIDDEN, scale=0.1)

    fc = randn(HIDDEN, 3 * HIDDEN, scale=0.05)
    fc[:, :HIDDEN] += torch.eye(HIDDEN)
    tensors = {
        "fc.weight": fc,
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": randn(heads * head_dim, 2 * HIDDEN, scale=0.1),
        "midlayer.self_attn.k_proj.weight": randn(kv_heads * head_dim, 2 * HIDDEN, scale=0.1),
        "midlayer.self_attn.v_proj.weight": randn(kv_heads * head_dim, 2 * HIDDEN, scale=0.1),
        "midlayer.self_attn.o_proj.weight": randn(HIDDEN, heads * head_dim, scale=0.005),
        "midlayer.mlp.gate_proj.weight": randn(128, HIDDEN, scale=0.1),
        "midlayer.mlp.up_proj.weight": randn(128, HIDDEN, scale=0.1),
        "midlayer.mlp.down_proj.weight": randn(HIDDEN, 128, scale=0.005),
        "norm.weight": norm(),
        "lm_head.weight": embed[ids].clone(),
    }
    if draft_ids is not None:
        tensors["d2t"] = draft_ids - torch.arange(len(draft_ids))
        t2d = torch.zeros(VOCAB, dtype=torch.bool)
        t2d[draft_ids] = True
        tensors["t2d"] = t2d
    return tensors


def _save_head(path: Path, tensors: dict[str, torch.Tensor], **overrides: object) -> str:
    from safetensors.torch import save_file

    config = transformers.LlamaConfig(**{**CONFIG, "num_hidden_layers": 1}).to_dict()
    draft_vocab = len(tensors["d2t"]) if "d2t" in tensors else VOCAB
    config.update(architectures=["LlamaForCausalLMEagle3"], tie_word_embeddings=False,
                  draft_vocab_size=draft_vocab)  # fmt: skip
    config.update(overrides)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def _draft_ids(seed: int) -> torch.Tensor:
    """Half of the target's vocabulary, always with the prompts' tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = set(torch.randperm(VOCAB, generator=g)[: VOCAB // 2].tolist()) | {1, 5, 6, 7, 9, 11, 40}
    return torch.tensor(sorted(ids))


def _llm(model: Path, speculative_config: dict[str, object] | None, **kwargs: int) -> LLM:
    return LLM(
        str(model), device="cpu", dtype="float32", max_model_len=128,
        kv_cache_memory=8 << 20, speculative_config=speculative_config, **kwargs,
    )  # fmt: skip


def _generate(llm: LLM) -> list[list[int]]:
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _spec(head: str, k: int = 3) -> dict[str, object]:
    return {"method": "eagle3", "model": head, "num_speculative_tokens": k}


@pytest.mark.parametrize("draft_vocab", [False, True], ids=["target-vocab", "d2t"])
def test_greedy_output_equals_no_speculation(
    target: Path, expected: list[list[int]], tmp_path: Path, draft_vocab: bool
) -> None:
    tensors = _head_tensors(target, 1, _draft_ids(1) if draft_vocab else None)
    llm = _llm(target, _spec(_save_head(tmp_path / "head", tensors)))
    try:
        assert _generate(llm) == expected
        stats = llm.engine.scheduler.spec_stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    finally:
        llm.close()


class _Reference:
    """The head's greedy proposals after `tokens`, recomputed from scratch with
    transformers: the target's hidden states entering layers 2, 3, 4 through fc, then per
    position [input_layernorm(embedding of token p + 1) | hidden_norm(hidden state at p)]
    through attention (the hidden state is the residual), the MLP and norm to lm_head; each
    proposal feeds its token and the pre-norm output to the next position."""

    def __init__(self, target: Path, tensors: dict[str, torch.Tensor]) -> None:
        llama = transformers.models.llama.modeling_llama
        self.target = transformers.LlamaForCausalLM.from_pretrained(target).float().eval()
        config = transformers.LlamaConfig(**{**CONFIG, "num_hidden_layers": 1})
        config._attn_implementation = "eager"
        self.attn = llama.LlamaAttention(config, 0)
        for name in ("q_proj", "k_proj", "v_proj"):
            weight = tensors[f"midlayer.self_attn.{name}.weight"]
            setattr(self.attn, name, torch.nn.Linear(2 * HIDDEN, weight.shape[0], bias=False))
        norms = ("input_layernorm", "hidden_norm", "post_attention_layernorm")
        self.mid = torch.nn.ModuleDict(
            {"self_attn": self.attn, "mlp": llama.LlamaMLP(config)}
            | {n: llama.LlamaRMSNorm(HIDDEN, config.rms_norm_eps) for n in norms}
        )
        self.norm = llama.LlamaRMSNorm(HIDDEN, config.rms_norm_eps)
        root = torch.nn.ModuleDict({"midlayer": self.mid, "norm": self.norm})
        names = set(root.state_dict())
        assert names <= set(tensors), names - set(tensors)
        root.load_state_dict({n: t for n, t in tensors.items() if n in names})
        self.rotary = llama.LlamaRotaryEmbedding(config)
        self.fc, self.lm_head = tensors["fc.weight"], tensors["lm_head.weight"]
        ids = torch.arange(self.lm_head.shape[0])
        self.to_target = ids + tensors["d2t"] if "d2t" in tensors else ids

    def proposals(self, tokens: list[int], k: int) -> list[int]:
        out = self.target.model(torch.tensor([tokens]), output_hidden_states=True)
        aux = torch.cat([out.hidden_states[j][0, :-1] for j in AUX_LAYERS], dim=-1)
        hidden = aux @ self.fc.T
        embed = self.target.model.embed_tokens.weight
        embeds = embed[tokens[1:]]
        drafts: list[int] = []
        for _ in range(k):
            n = embeds.shape[0]
            mid = self.mid
            x = torch.cat([mid.input_layernorm(embeds), mid.hidden_norm(hidden)], dim=-1)[None]
            positions = torch.arange(n)[None]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            attn, _ = self.attn(x, self.rotary(x, positions), mask)
            x = attn[0] + hidden
            x = mid.mlp(mid.post_attention_layernorm(x)) + x
            draft = int((self.lm_head @ self.norm(x[-1])).argmax())
            token = int(self.to_target[draft])
            drafts.append(token)
            embeds = torch.cat([embeds, embed[token][None]])
            hidden = torch.cat([hidden, x[-1][None]])
        return drafts


@torch.no_grad()
def test_proposals_equal_an_eagle3_reference(target: Path, tmp_path: Path) -> None:
    """Every proposal round (prompts prefilled in chunks, some proposals accepted, the
    second pass reading the head's K/V of prefix-cached blocks) proposes what the head
    computed from scratch proposes, all of them in the draft vocabulary."""
    draft_ids = _draft_ids(2)
    tensors = _head_tensors(target, 2, draft_ids)
    head = _save_head(tmp_path / "head", tensors)
    reference = _Reference(target, tensors)
    prompts = [{"prompt_token_ids": [1, *range(20 + i, 41 + i)]} for i in range(2)]
    llm = _llm(target, _spec(head), max_num_batched_tokens=16)
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
    allowed = set(draft_ids.tolist())
    for tokens, drafts in seen:
        assert set(drafts) <= allowed
        assert drafts == reference.proposals(tokens, 3)


def test_eagle3_config_holds_lookahead_slots() -> None:
    from asyncserve.spec_decode.config import SpeculativeConfig

    spec = SpeculativeConfig.from_value(_spec("/heads/eagle3", 4))
    assert (spec.method, spec.model, spec.num_lookahead_tokens) == ("eagle3", "/heads/eagle3", 4)


def test_missing_d2t_fails_at_start(target: Path, tmp_path: Path) -> None:
    tensors = _head_tensors(target, 3, _draft_ids(3))
    draft_vocab = len(tensors.pop("d2t"))
    head = _save_head(tmp_path / "head", tensors, draft_vocab_size=draft_vocab)
    with pytest.raises(ValueError, match=r"draft_vocab_size \(1\d\d\) differs from vocab_size "
                       r"\(320\) but it has no d2t tensor"):  # fmt: skip
        _llm(target, _spec(head))


def _load(path: str) -> object:
    from asyncserve.models.arch_config import ArchConfig
    from asyncserve.spec_decode.eagle3_head import load_eagle3_head

    arch = ArchConfig.from_hf_dict(transformers.LlamaConfig(**CONFIG).to_dict())
    return load_eagle3_head(path, arch, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize(
    ("edit", "overrides", "message"),
    [
        (None, {"target_hidden_size": 32},
         r"target_hidden_size \(32\) differs from the target's hidden_size \(64\)"),
        (None, {"vocab_size": 300}, r"vocab_size \(300\) differs from the target's \(320\)"),
        (None, {"eagle_aux_hidden_state_layer_ids": [1, 5, 5]},
         r"fc.weight has shape \(64, 192\); the target layers \[1, 5\] give 128 inputs"),
        (None, {"eagle_aux_hidden_state_layer_ids": [1, 3, 7]}, r"not all in \[0, 7\)"),
        (None, {"num_hidden_layers": 2}, "has one decoder layer, got num_hidden_layers 2"),
        ("d2t", {}, r"d2t maps draft ids outside the target vocabulary \[0, 320\)"),
        ("lm_head", {}, "is missing 1 weights: lm_head.weight"),
        ("midlayer", {}, r"has no midlayer.\* tensors \(for an EAGLE-1 head, use method 'eagle'\)"),
    ],
)  # fmt: skip
def test_bad_heads_are_one_line_errors(
    target: Path, tmp_path: Path, edit: str | None, overrides: dict[str, object], message: str
) -> None:
    tensors = _head_tensors(target, 4, _draft_ids(4))
    if edit == "d2t":
        tensors["d2t"][-1] = VOCAB
    elif edit == "lm_head":
        del tensors["lm_head.weight"]
    elif edit == "midlayer":
        tensors = {n: t for n, t in tensors.items() if not n.startswith("midlayer.")}
    head = _save_head(tmp_path / "head", tensors, **overrides)
    with pytest.raises(ValueError, match=message) as info:
        _load(head)
    assert "\n" not in str(info.value) and str(info.value).startswith("speculative_config:")


def test_layer_ids_from_the_config_and_pytorch_bin(target: Path, tmp_path: Path) -> None:
    """A head trained on other layers names them; a .bin checkpoint (with `layers.0.`
    names) loads the same weights as the safetensors one."""
    from asyncserve.spec_decode.eagle3_head import Eagle3Head

    tensors = _head_tensors(target, 5, _draft_ids(5))
    head = _load(_save_head(tmp_path / "st", tensors, eagle_aux_hidden_state_layer_ids=[6, 0, 3]))
    assert isinstance(head, Eagle3Head) and head.aux_layers == (0, 3, 6)
    renamed = {n.replace("midlayer.", "layers.0."): t for n, t in tensors.items()}
    (tmp_path / "bin").mkdir()
    torch.save(renamed, tmp_path / "bin" / "pytorch_model.bin")
    config = json.loads((tmp_path / "st" / "config.json").read_text())
    (tmp_path / "bin" / "config.json").write_text(json.dumps(config))
    from_bin = _load(str(tmp_path / "bin"))
    assert isinstance(from_bin, Eagle3Head) and from_bin.aux_layers == (0, 3, 6)
    for (name, a), (_, b) in zip(
        head.state_dict().items(), from_bin.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_an_eagle3_head_needs_method_eagle3(target: Path, tmp_path: Path) -> None:
    from asyncserve.models.arch_config import ArchConfig
    from asyncserve.spec_decode.eagle_head import load_eagle_head

    head = _save_head(tmp_path / "head", _head_tensors(target, 6, None))
    arch = ArchConfig.from_hf_dict(transformers.LlamaConfig(**CONFIG).to_dict())
    with pytest.raises(ValueError, match="is an EAGLE-3 head: use method 'eagle3'"):
        load_eagle_head(head, arch, torch.float32, torch.device("cpu"))


def test_sampling_outside_the_draft_vocabulary(target: Path, tmp_path: Path) -> None:
    """Allowed tokens none of which the head can propose: its proposals come from a uniform
    q and are rejected, and the output keeps to the allowed tokens."""
    allowed = [261, 262, 263]
    draft_ids = torch.tensor([i for i in range(VOCAB) if i not in allowed])
    head = _save_head(tmp_path / "head", _head_tensors(target, 7, draft_ids))
    llm = _llm(target, _spec(head))
    try:
        params = [
            SamplingParams(temperature=0.7, max_tokens=6, seed=i, ignore_eos=True,
                           allowed_token_ids=allowed)
            for i in range(4)
        ]  # fmt: skip
        outputs = llm.generate(PROMPTS[:1] * 4, params, use_tqdm=False)
        stats = llm.engine.scheduler.spec_stats
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == 0, stats
    finally:
        llm.close()
    for out in outputs:
        tokens = out.outputs[0].token_ids
        assert len(tokens) == 6 and set(tokens) <= set(allowed), tokens
