"""Beam search: vLLM's scoring, and equality with HF transformers' beam search on SmolLM2."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from asyncserve import BeamSearchParams
from asyncserve.beam_search import get_beam_search_score
from asyncserve.llm import LLM

EOS = 2


@pytest.fixture(scope="module")
def llm(smollm2_llm: LLM) -> LLM:
    return smollm2_llm


def hf_beams(
    model: Any, prompt: list[int], k: int, max_new_tokens: int, **config: Any
) -> tuple[list[list[int]], list[float]]:
    """HF's k returned sequences (output tokens, through the first EOS) and their scores."""
    from transformers import GenerationConfig

    generation_config = GenerationConfig(
        num_beams=k,
        num_return_sequences=k,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        output_scores=True,
        return_dict_in_generate=True,
        **config,
    )
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), generation_config=generation_config)
    sequences = []
    for row in out.sequences.tolist():
        tokens = row[len(prompt) :]
        if config.get("eos_token_id") is not None and EOS in tokens:
            tokens = tokens[: tokens.index(EOS) + 1]
        sequences.append(tokens)
    return sequences, [float(s) for s in out.sequences_scores]


def chat_ids(llm: LLM, question: str) -> list[int]:
    tokenizer = llm.get_tokenizer()
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True
    )
    return tokenizer.encode(text, add_special_tokens=False)


def test_score_counts_prompt_and_output_but_not_the_final_eos() -> None:
    assert get_beam_search_score([5, 6, 7, 8], -2.0, EOS, 1.0) == pytest.approx(-0.5)
    assert get_beam_search_score([5, 6, 7, EOS], -2.0, EOS, 1.0) == pytest.approx(-2.0 / 3)
    assert get_beam_search_score([5, 6, 7, EOS], -2.0, [9, EOS], 2.0) == pytest.approx(-2.0 / 9)
    assert get_beam_search_score([5, 6, 7, EOS], -2.0, None, 1.0) == pytest.approx(-0.5)
    assert get_beam_search_score([5, 6, 7, 8], -2.0, EOS, 0.0) == pytest.approx(-2.0)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"beam_width": 0, "max_tokens": 4}, "beam_width"),
        ({"beam_width": 11, "max_tokens": 4}, "beam_width"),
        ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
        ({"beam_width": 2, "max_tokens": 4, "temperature": -1.0}, "temperature"),
        ({"beam_width": 2, "max_tokens": 4, "temperature": "1"}, "temperature"),
        ({"beam_width": 2, "max_tokens": 4, "length_penalty": float("nan")}, "length_penalty"),
        ({"beam_width": 2, "max_tokens": 4, "length_penalty": float("inf")}, "length_penalty"),
        ({"beam_width": 2, "max_tokens": 4, "length_penalty": None}, "length_penalty"),
    ],
)
def test_invalid_params_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        BeamSearchParams(**kwargs)


@pytest.mark.parametrize("params", [5, None, {"beam_width": 2, "max_tokens": 4}])
def test_beam_search_takes_only_beam_search_params(llm: LLM, params: Any) -> None:
    with pytest.raises(ValueError, match="params must be a BeamSearchParams"):
        llm.beam_search(["Hi"], params)
    assert llm.engine.num_running == 0 and llm.engine.num_waiting == 0


@pytest.mark.parametrize(("k", "length_penalty"), [(2, 1.0), (4, 0.5)])
def test_equals_hf_without_eos(llm: LLM, hf_smollm2: Any, k: int, length_penalty: float) -> None:
    """ignore_eos against HF with no EOS: the same search, every beam must match."""
    model = hf_smollm2[0]
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = BeamSearchParams(
        beam_width=k, max_tokens=8, ignore_eos=True, length_penalty=length_penalty
    )
    outputs = llm.beam_search(prompts, params)
    tokenizer = llm.get_tokenizer()
    for prompt, output in zip(prompts, outputs, strict=True):
        ids = tokenizer.encode(prompt)
        expected, scores = hf_beams(
            model, ids, k, 8, length_penalty=length_penalty, eos_token_id=None, pad_token_id=0
        )
        assert [s.output_token_ids for s in output.sequences] == expected
        # HF reports cum_logprob / new_tokens ** length_penalty.
        cum = [score * 8**length_penalty for score in scores]
        assert [s.cum_logprob for s in output.sequences] == pytest.approx(cum, abs=2e-3)
        for seq in output.sequences:
            assert seq.tokens[: len(ids)] == ids and len(seq.output_token_ids) == 8
            assert seq.finish_reason == "length"
            assert seq.text == tokenizer.decode(seq.tokens, skip_special_tokens=False)
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


@pytest.mark.parametrize(
    ("question", "k", "length_penalty", "early_stopping"),
    [
        ("What is 2+2? Answer with a number only.", 2, 0.0, "never"),
        ("What is 2+2? Answer with a number only.", 4, 1.0, True),
        ("Say hi.", 4, 0.0, "never"),
    ],
)
def test_top_beam_equals_hf_with_eos(
    llm: LLM, hf_smollm2: Any, question: str, k: int, length_penalty: float, early_stopping: Any
) -> None:
    ids = chat_ids(llm, question)
    params = BeamSearchParams(beam_width=k, max_tokens=16, length_penalty=length_penalty)
    output = llm.beam_search({"prompt_token_ids": ids}, params)[0]
    expected, _ = hf_beams(
        model=hf_smollm2[0],
        prompt=ids,
        k=k,
        max_new_tokens=16,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        eos_token_id=EOS,
        pad_token_id=EOS,
    )
    top = output.sequences[0]
    assert top.output_token_ids == expected[0]
    if question.startswith("What is 2+2"):
        assert top.output_token_ids[-1] == EOS and top.finish_reason == "stop"


def test_eos_candidates_outside_the_top_k_complete_as_in_vllm(llm: LLM, hf_smollm2: Any) -> None:
    """vLLM completes every EOS among a beam's top 2k; HF only those ranked in the top k.

    On this prompt the best sequence ends with an EOS that HF's rule drops: ours returns it,
    with a higher cumulative logprob than anything HF keeps.
    """
    ids = chat_ids(llm, "What color is the sky? One word.")
    params = BeamSearchParams(beam_width=4, max_tokens=16, length_penalty=0.0)
    output = llm.beam_search({"prompt_token_ids": ids}, params)[0]
    _, hf_scores = hf_beams(
        hf_smollm2[0], ids, 4, 16, length_penalty=0.0, early_stopping="never", eos_token_id=EOS
    )
    top = output.sequences[0]
    assert top.output_token_ids[-1] == EOS and top.finish_reason == "stop"
    assert top.cum_logprob > max(hf_scores) + 1.0


def test_sorted_scored_and_prefix_blocks_shared(llm: LLM) -> None:
    engine = llm.engine
    ids = chat_ids(llm, "Write one sentence about the sea, please, in plain words.")
    assert len(ids) > 2 * engine.config.cache.block_size
    hits_before = engine.scheduler.prefix_cache_hits
    params = BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=1.0)
    output = llm.beam_search([{"prompt_token_ids": ids}], params)[0]
    eos = set(engine.eos_token_ids)
    scores = [get_beam_search_score(s.tokens, s.cum_logprob, eos, 1.0) for s in output.sequences]
    assert len(output.sequences) == 3 and scores == sorted(scores, reverse=True)
    for seq in output.sequences:
        assert seq.finish_reason == ("stop" if seq.tokens[-1] in eos else "length")
        assert seq.cum_logprob == pytest.approx(
            sum(step[t].logprob for step, t in zip(seq.logprobs, seq.output_token_ids, strict=True))
        )
    # Every step after the first reuses the prompt's full blocks for every beam.
    full_prompt_tokens = len(ids) // engine.config.cache.block_size * engine.config.cache.block_size
    assert engine.scheduler.prefix_cache_hits - hits_before >= 5 * 3 * full_prompt_tokens
    assert engine.num_free_blocks == engine.num_total_blocks


def test_beams_stop_at_max_model_len(llm: LLM) -> None:
    room = 5
    ids = llm.get_tokenizer().encode(" ".join(["water"] * 600))[: llm.engine.max_model_len - room]
    params = BeamSearchParams(beam_width=2, max_tokens=16, ignore_eos=True)
    output = llm.beam_search([ids], params)[0]
    assert len(output.sequences) == 2
    for seq in output.sequences:
        assert len(seq.tokens) == llm.engine.max_model_len and seq.finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len"):
        llm.beam_search([ids + [1] * room], params)
