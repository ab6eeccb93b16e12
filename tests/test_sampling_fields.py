"""Offline: allowed_token_ids, bad_words and truncate_prompt_tokens change the output as
vLLM's do, and bad values raise ValueError naming the field."""

from __future__ import annotations

import pytest

from asyncserve import SamplingParams
from asyncserve.llm import LLM

PROMPT = "The capital of France is"


def test_allowed_token_ids(smollm2_llm: LLM) -> None:
    allowed = [28, 29, 30, 31]
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=3, allowed_token_ids=allowed)
    out = smollm2_llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8
    assert set(out.outputs[0].token_ids) <= set(allowed)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        smollm2_llm.engine.validate_request([1, 2], SamplingParams(allowed_token_ids=[10**9]))
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])


def test_bad_words_across_steps(smollm2_llm: LLM) -> None:
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    plain = smollm2_llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].text
    assert "Paris" in plain
    # A multi-token word is ruled out at the token that would complete it.
    tokenizer = smollm2_llm.get_tokenizer()
    word = " Paris is"
    assert len(tokenizer.encode(word, add_special_tokens=False)) > 1
    for words in (["Paris"], [word.strip()]):
        params = SamplingParams(max_tokens=8, temperature=0.0, bad_words=words)
        text = smollm2_llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text
        assert words[0] not in text, text
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=[""])


def test_truncate_prompt_tokens(smollm2_llm: LLM) -> None:
    ids = smollm2_llm.get_tokenizer().encode("one two three four five six seven eight")
    params = SamplingParams(max_tokens=2, temperature=0.0, truncate_prompt_tokens=3)
    out = smollm2_llm.generate([ids], params, use_tqdm=False)[0]
    alone = smollm2_llm.generate([ids[-3:]], SamplingParams(max_tokens=2, temperature=0.0))[0]
    assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)
