"""LLM.embed() and LLM.score(): vLLM's offline pooling calls, checked against the producers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncserve import LLM, SamplingParams

TEXTS = ["the cat sat on the mat", "paris is the capital of france", "what is a river"]


def test_embed_and_cosine_score(st_bert_dir: Path) -> None:
    from sentence_transformers import SentenceTransformer

    llm = LLM(str(st_bert_dir), device="cpu")
    try:
        outs = llm.embed(TEXTS)
        got = torch.tensor([o.outputs.embedding for o in outs])
        want = SentenceTransformer(str(st_bert_dir), device="cpu").encode(
            TEXTS, convert_to_tensor=True
        )
        torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-4)
        assert outs[0].prompt_token_ids == llm.get_tokenizer().encode(TEXTS[0])
        # Token ids embed as their text does.
        again = llm.embed([{"prompt_token_ids": outs[1].prompt_token_ids}])
        assert again[0].outputs.embedding == pytest.approx(outs[1].outputs.embedding, abs=1e-6)
        # vLLM's encode(): the same vectors as tensors; other tasks are a ValueError.
        encoded = llm.encode(TEXTS, pooling_task="embed")
        torch.testing.assert_close(torch.stack([o.outputs.data for o in encoded]), got)
        assert encoded[0].prompt_token_ids == outs[0].prompt_token_ids
        with pytest.raises(ValueError, match="pooling_task"):
            llm.encode(TEXTS, pooling_task="classify")
        with pytest.raises(ValueError, match=r"prompts\[0\]\[0\] must be a token id"):
            llm.encode([[0.5]])
        # An embedding model scores by cosine similarity.
        scores = llm.score(TEXTS[0], TEXTS[1:])
        want_cos = torch.nn.functional.cosine_similarity(want[0:1], want[1:]).tolist()
        assert [s.outputs.score for s in scores] == pytest.approx(want_cos, abs=1e-5)
        with pytest.raises(ValueError, match="pooling model"):
            llm.generate("the cat", SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="input has 0 tokens|must not be empty"):
            llm.embed([[]])
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.embed([[10**6]])
    finally:
        llm.close()


def test_cross_encoder_scores(cross_encoder_dir: Path) -> None:
    from sentence_transformers import CrossEncoder

    llm = LLM(str(cross_encoder_dir), device="cpu")
    try:
        docs = ["the sea", "a big city", "one two three"]
        got = [s.outputs.score for s in llm.score("what is a river", docs)]
        want = CrossEncoder(str(cross_encoder_dir), device="cpu").predict(
            [("what is a river", d) for d in docs]
        )
        assert got == pytest.approx(want.tolist(), abs=1e-5)
        with pytest.raises(ValueError, match="cross-encoder"):
            llm.embed("the sea")
    finally:
        llm.close()


def test_embed_needs_a_pooling_model(smollm2_llm: LLM) -> None:
    with pytest.raises(ValueError, match="runner='pooling'"):
        smollm2_llm.embed("hello")
    with pytest.raises(ValueError, match="runner='pooling'"):
        smollm2_llm.encode("hello")
