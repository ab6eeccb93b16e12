"""End to end: tokens sampled with n-gram speculation follow the model's distribution.

A tiny random Llama (three allowed tokens, so each position's distribution is small enough
to check) continues a prompt whose every suffix matches earlier, so every step after the
first verifies a proposal. The joint distribution of the first three sampled tokens is
compared with the exact one computed from transformers' logits (chi-square, seeded draws).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from asyncserve.llm import LLM
from asyncserve.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")

ALLOWED = [261, 262, 263]
PROMPT = [1] + ALLOWED * 3 + ALLOWED[:2]
TEMPERATURE = 0.7
NUM_SAMPLES = 3000
# Chi-square critical value, 26 degrees of freedom, p = 0.001.
CHI2_CRITICAL_26 = 54.05


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    torch.manual_seed(3)
    config = transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():  # spread the three tokens' logits so the distributions differ
        model.lm_head.weight.normal_(0.0, 0.5)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def _exact_joint(model: object) -> dict[tuple[int, ...], float]:
    """P(t1, t2, t3) with the logits restricted to ALLOWED, at TEMPERATURE."""

    def next_probs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].double()  # type: ignore[operator]
        return torch.softmax(logits[ALLOWED] / TEMPERATURE, dim=0)

    joint: dict[tuple[int, ...], float] = {}
    for a in range(3):
        pa = next_probs(PROMPT)[a].item()
        for b in range(3):
            pb = next_probs([*PROMPT, ALLOWED[a]])[b].item()
            pc = next_probs([*PROMPT, ALLOWED[a], ALLOWED[b]])
            for c in range(3):
                joint[(ALLOWED[a], ALLOWED[b], ALLOWED[c])] = pa * pb * pc[c].item()
    return joint


@pytest.mark.parametrize("method", ["ngram", "eagle", "eagle3"])
def test_sampled_tokens_follow_the_target_distribution(
    tiny_llama: tuple[Path, object], tmp_path: Path, method: str
) -> None:
    """With EAGLE (a random head) the proposals are drawn from the head's own distribution
    q, which the rejection sampler must correct to the target's; the EAGLE-3 head's draft
    vocabulary lacks one of the allowed tokens (q is 0 there)."""
    path, model = tiny_llama
    spec: dict[str, object] = {"method": "ngram", "num_speculative_tokens": 2,
                               "prompt_lookup_min": 1, "prompt_lookup_max": 2}  # fmt: skip
    if method == "eagle":
        from tests.spec_decode.test_eagle import _save_head

        torch.manual_seed(4)
        head = _save_head(tmp_path / "head", max_position_embeddings=128)
        spec = {"method": "eagle", "model": head, "num_speculative_tokens": 2}
    elif method == "eagle3":
        from tests.spec_decode.test_eagle3 import _head_tensors
        from tests.spec_decode.test_eagle3 import _save_head as save_eagle3

        draft_ids = torch.tensor([i for i in range(320) if i != ALLOWED[2]])
        tensors = _head_tensors(path, 4, draft_ids)
        # Two target layers: the head reads the residual stream entering both.
        tensors["fc.weight"] = tensors["fc.weight"][:, :128].contiguous()
        head = save_eagle3(tmp_path / "head", tensors, max_position_embeddings=128,
                           eagle_aux_hidden_state_layer_ids=[0, 1])  # fmt: skip
        spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 2}
    llm = LLM(
        str(path),
        device="cpu",
        dtype="float32",
        max_model_len=64,
        kv_cache_memory=16 << 20,
        speculative_config=spec,
    )
    try:
        params = [
            SamplingParams(temperature=TEMPERATURE, max_tokens=3, seed=i, ignore_eos=True,
                           allowed_token_ids=ALLOWED)
            for i in range(NUM_SAMPLES)
        ]  # fmt: skip
        prompts = [{"prompt_token_ids": PROMPT}] * NUM_SAMPLES
        outputs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.engine.scheduler.spec_stats
        # Every request verified a proposal after its first token.
        assert stats.num_drafts >= NUM_SAMPLES
        assert 0.1 < stats.acceptance_rate < 0.9, stats
    finally:
        llm.close()
    counts = dict.fromkeys(itertools.product(ALLOWED, repeat=3), 0)
    for out in outputs:
        counts[tuple(out.outputs[0].token_ids)] += 1  # type: ignore[index]
    joint = _exact_joint(model)
    assert max(joint.values()) > 3 * min(joint.values())  # a distribution worth testing
    stat = sum((counts[k] - NUM_SAMPLES * p) ** 2 / (NUM_SAMPLES * p) for k, p in joint.items())
    assert stat < CHI2_CRITICAL_26, (stat, counts)
