"""Offline: allowed_token_ids, bad_words and truncate_prompt_tokens change the output as
vLLM's do, and bad values (min_tokens past max_model_len included) raise ValueError naming
the field."""

from __future__ import annotations

import re
from typing import Any

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


@pytest.mark.parametrize("max_tokens", [None, 100])
def test_min_tokens_past_max_model_len_raise_before_anything_runs(
    smollm2_llm: LLM, monkeypatch: pytest.MonkeyPatch, max_tokens: int | None
) -> None:
    # max_model_len is 512: a 500-token prompt leaves room for 12 output tokens, so
    # min_tokens=20 could never be met (the output would be capped at 12).
    queued: list[Any] = []
    add_request = smollm2_llm.engine.add_request

    def recording_add_request(*args: Any, **kwargs: Any) -> Any:
        queued.append(args)
        return add_request(*args, **kwargs)

    monkeypatch.setattr(smollm2_llm.engine, "add_request", recording_add_request)
    limit = "max_tokens (12: what" if max_tokens is None else "12 (what"
    message = f"min_tokens must be <= {limit} max_model_len 512 leaves after the 500-token prompt"
    params = SamplingParams(temperature=0.0, min_tokens=20, max_tokens=max_tokens)
    # A text prompt is measured as the engine tokenizes it (" x" is one token, BOS none).
    cases: list[list[Any]] = [[[100] * 500], ["Hi", {"prompt_token_ids": [100] * 500}]]
    for prompts in [*cases, ["Hi", " x" * 500]]:
        with pytest.raises(ValueError, match=re.escape(f"{message}), got 20")):
            smollm2_llm.generate(prompts, params, use_tqdm=False)
    assert queued == []
    # Where min_tokens fit, the output is that long.
    fits = SamplingParams(temperature=0.0, min_tokens=12, max_tokens=max_tokens)
    out = smollm2_llm.generate([[100] * 500], fits, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 12 and out.finish_reason == "length"
