"""Speculative decoding on the GPU: Triton kernels, CUDA graphs for the steps without
proposals, for the verification steps and for the draft model's and EAGLE head's one-token
proposal steps, the draft's pool on the device (skipped without CUDA)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncserve import SamplingParams
from asyncserve.llm import LLM
from asyncserve.spec_decode.model_proposer import ModelProposer
from tests.conftest import PLAIN_PROMPTS
from tests.spec_decode.test_ngram_engine import NGRAM, REPEATING

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = PLAIN_PROMPTS + REPEATING
PARAMS = SamplingParams(temperature=0.0, max_tokens=48)


def _greedy(
    gguf_path: Path, spec: dict[str, object] | None, enforce_eager: bool = False
) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(gguf_path), device="cuda", dtype="float32", speculative_config=spec,
              enforce_eager=enforce_eager)  # fmt: skip
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs], llm


def _prefix_match(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of positions equal up to each pair's first divergence (after it the two go on
    from different text; fp32 kernels for 1 and k + 1 query rows may differ in the last bit)."""
    matched = total = 0
    for x, y in zip(a, b, strict=True):
        total += len(y)
        for p, q in zip(x, y, strict=False):
            if p != q:
                break
            matched += 1
    return matched / total


def smollm2_eagle_head(
    gguf_path: Path, path: Path, edit: Callable[[dict[str, torch.Tensor]], None] | None = None
) -> str:
    """A random EAGLE-1 head with SmolLM2's shapes (no trained head exists for it)."""
    import json

    import transformers
    from safetensors.torch import save_file

    from asyncserve.models.gguf_loader import gguf_hf_config, open_gguf

    config = {**gguf_hf_config(open_gguf(gguf_path)), "num_hidden_layers": 1}
    torch.manual_seed(0)
    layer = transformers.models.llama.modeling_llama.LlamaDecoderLayer(
        transformers.LlamaConfig(**config), 0
    )
    hidden = config["hidden_size"]
    tensors = {"fc.weight": torch.randn(hidden, 2 * hidden) / (2 * hidden) ** 0.5}
    for name, tensor in layer.state_dict().items():
        if not name.startswith("input_layernorm."):
            tensors[f"layers.0.{name}"] = tensor.float().contiguous()
    if edit is not None:
        edit(tensors)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def smollm2_eagle3_head(gguf_path: Path, path: Path) -> str:
    """A random EAGLE-3 head with SmolLM2's shapes over a draft vocabulary of 8192 ids."""
    import json

    from safetensors.torch import save_file

    from asyncserve.models.gguf_loader import gguf_hf_config, open_gguf

    config = {**gguf_hf_config(open_gguf(gguf_path)), "num_hidden_layers": 1}
    hidden, vocab, inter = config["hidden_size"], config["vocab_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    q, kv = hidden, config["num_key_value_heads"] * head_dim
    draft_ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[:8192].sort()[0]
    g = torch.Generator().manual_seed(1)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

    tensors = {
        "fc.weight": randn(hidden, 3 * hidden),
        "midlayer.self_attn.q_proj.weight": randn(q, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": randn(kv, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": randn(kv, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": randn(hidden, q),
        "midlayer.mlp.gate_proj.weight": randn(inter, hidden),
        "midlayer.mlp.up_proj.weight": randn(inter, hidden),
        "midlayer.mlp.down_proj.weight": randn(hidden, inter),
        "lm_head.weight": randn(len(draft_ids), hidden),
        "d2t": draft_ids - torch.arange(len(draft_ids)),
    }
    for norm in ("midlayer.input_layernorm", "midlayer.hidden_norm",
                 "midlayer.post_attention_layernorm", "norm"):  # fmt: skip
        tensors[f"{norm}.weight"] = torch.ones(hidden)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    config.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=len(draft_ids))
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("method", ["ngram", "draft", "eagle", "eagle3"])
def test_gpu_greedy_with_speculation(gguf_path: Path, tmp_path: Path, method: str) -> None:
    expected, base = _greedy(gguf_path, None)
    base.close()
    spec = NGRAM if method == "ngram" else {"model": str(gguf_path), "num_speculative_tokens": 3}
    if method == "eagle":
        head = smollm2_eagle_head(gguf_path, tmp_path / "head")
        spec = {"method": "eagle", "model": head, "num_speculative_tokens": 3}
    elif method == "eagle3":
        head = smollm2_eagle3_head(gguf_path, tmp_path / "head")
        spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 3}
    ours, llm = _greedy(gguf_path, spec)
    try:
        stats = llm.engine.scheduler.spec_stats
        print(f"{method}: acceptance {stats.acceptance_rate:.3f}, "
              f"mean accepted length {stats.mean_accepted_length:.2f}")  # fmt: skip
        assert stats.num_drafts > 0
        assert llm.engine.num_free_blocks == llm.engine.num_total_blocks
        if method != "ngram":  # the one-token proposal steps replayed graphs
            _assert_proposer_graphs(llm)
        if method == "draft":  # the model as its own draft: its proposals are the target's
            assert stats.acceptance_rate > 0.9, stats.acceptance_rate
    finally:
        llm.close()
    assert _prefix_match(ours, expected) >= 0.95


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_gpu_verification_graphs_equal_eager(gguf_path: Path, method: str) -> None:
    """Verification steps replaying graphs of k + 1 rows a request (padded where a request
    has fewer proposals) give the eager steps' greedy tokens."""
    spec = NGRAM if method == "ngram" else {"model": str(gguf_path), "num_speculative_tokens": 3}
    expected, eager = _greedy(gguf_path, spec, enforce_eager=True)
    eager.close()
    llm = LLM(str(gguf_path), device="cuda", dtype="float32", speculative_config=spec)
    try:
        runner = llm.engine.runner
        assert runner is not None
        graphs = runner.verify_graphs
        assert graphs is not None and sorted(graphs.graphs) == graphs.sizes
        assert graphs.query_len == int(spec["num_speculative_tokens"]) + 1  # type: ignore[call-overload]
        replay = graphs.replay
        counts: list[list[int] | None] = []

        def counted(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
            counts.append(args[3] if len(args) > 3 else kwargs.get("counts"))
            return replay(*args, **kwargs)

        graphs.replay = counted  # type: ignore[method-assign]
        outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        ours = [list(o.outputs[0].token_ids) for o in outputs]
    finally:
        llm.close()
    assert counts, "no verification step replayed a graph"
    assert ours == expected


def _assert_proposer_graphs(llm: LLM) -> None:
    runner = llm.engine.runner
    assert runner is not None
    proposer = runner.proposer
    assert isinstance(proposer, ModelProposer) and proposer.graphs is not None
    assert proposer.graphs.graphs, "no proposer graph was captured"


def test_gpu_eagle_graph_steps_feed_back_the_head_output(gguf_path: Path, tmp_path: Path) -> None:
    """A pass-through head (fc = [0 | I], a layer that adds nothing) outputs the target's
    hidden state, whose logits gave the request's last token, and feeds it back: every
    proposal of every step repeats the last token. Steps 2..k replay graphs; a stale or
    misplaced fed-back row in their buffers would propose other tokens."""

    def pass_through(tensors: dict[str, torch.Tensor]) -> None:
        hidden = tensors["fc.weight"].shape[0]
        tensors["fc.weight"] = torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], 1)
        tensors["layers.0.self_attn.o_proj.weight"].zero_()
        tensors["layers.0.mlp.down_proj.weight"].zero_()

    head = smollm2_eagle_head(gguf_path, tmp_path / "head", pass_through)
    spec = {"method": "eagle", "model": head, "num_speculative_tokens": 3}
    llm = LLM(str(gguf_path), device="cuda", dtype="float32", speculative_config=spec)
    try:
        runner = llm.engine.runner
        assert runner is not None and runner.proposer is not None
        propose = runner.proposer.propose
        seen: list[tuple[int, list[int]]] = []

        def observed(states: list) -> dict[str, list[int]]:  # type: ignore[type-arg]
            out = propose(states)
            # (A request whose hidden states the target did not compute proposes nothing.)
            seen.extend((s.output_token_ids[-1], out[s.request_id])
                        for s in states if s.request_id in out)  # fmt: skip
            return out

        runner.proposer.propose = observed  # type: ignore[method-assign]
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        _assert_proposer_graphs(llm)
    finally:
        llm.close()
    graph_steps = [d for _, drafts in seen for d in drafts[1:]]
    assert len(seen) > len(PROMPTS)
    # fp32 logits of one row in batches of other shapes may differ in the last bit.
    repeats = sum(d == last for last, drafts in seen for d in drafts[1:])
    assert repeats >= 0.95 * len(graph_steps), seen
