"""Pooled vectors equal the producers' own: sentence-transformers for a BERT (mean pooling),
transformers for a Qwen3 body (last token), sentence-transformers' CrossEncoder for scores."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncserve.config import ModelConfig
from asyncserve.pooling.config import resolve_runner
from asyncserve.pooling.model import PoolingModel

TEXTS = ["the cat sat on the mat", "paris is the capital of france", "two", "what is a river"]


def _load(path: Path) -> PoolingModel:
    return PoolingModel.load(ModelConfig(model=str(path), dtype="float32"), torch.device("cpu"))


def test_bert_mean_pooling_equals_sentence_transformers(st_bert_dir: Path) -> None:
    from sentence_transformers import SentenceTransformer

    ours = _load(st_bert_dir)
    assert ours.pooler.pooling_type == "MEAN" and ours.pooler.normalize
    ids = [ours.tokenizer.encode(t) for t in TEXTS]
    got = ours.pool(ids)
    want = SentenceTransformer(str(st_bert_dir), device="cpu").encode(TEXTS, convert_to_tensor=True)
    torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-4)
    assert resolve_runner("auto", st_bert_dir) == "pooling"


def test_qwen3_body_last_token_equals_transformers(qwen3_body_dir: Path) -> None:
    from transformers import Qwen3Model

    ours = _load(qwen3_body_dir)
    assert ours.pooler.pooling_type == "LAST" and ours.pooler.normalize
    ref = Qwen3Model.from_pretrained(qwen3_body_dir, torch_dtype=torch.float32).eval()
    ids = [ours.tokenizer.encode(t) for t in TEXTS]
    got = ours.pool(ids)  # one batch of different lengths
    for row, seq in zip(got, ids, strict=True):
        with torch.no_grad():
            hidden = ref(torch.tensor([seq])).last_hidden_state[0, -1]
        torch.testing.assert_close(
            row, torch.nn.functional.normalize(hidden, dim=-1), atol=1e-5, rtol=1e-4
        )
    assert resolve_runner("auto", qwen3_body_dir) == "pooling"


def test_cross_encoder_logits_equal_sentence_transformers(cross_encoder_dir: Path) -> None:
    from sentence_transformers import CrossEncoder

    ours = _load(cross_encoder_dir)
    assert ours.is_cross_encoder
    pairs = [("what is a river", "the sea"), ("paris", "capital of france"), ("one", "two three")]
    encoded = [ours.tokenizer.backend.encode(a, b) for a, b in pairs]
    logits = ours.classify([e.ids for e in encoded], [e.type_ids for e in encoded])
    want = CrossEncoder(str(cross_encoder_dir), device="cpu").predict(pairs, convert_to_tensor=True)
    torch.testing.assert_close(torch.sigmoid(logits[:, 0]), want.float(), atol=1e-5, rtol=1e-4)


def test_generation_checkpoints_keep_the_generate_runner(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    assert resolve_runner("auto", tmp_path) == "generate"
    assert resolve_runner("auto", None) == "generate"
    with pytest.raises(ValueError, match="runner must be"):
        resolve_runner("embed", tmp_path)


@pytest.mark.parametrize(
    ("text", "match"), [("[1, 2]", "must hold a JSON object"), ("\udcff", "cannot read")]
)
def test_unreadable_config_is_a_value_error(tmp_path: Path, text: str, match: str) -> None:
    (tmp_path / "config.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(ValueError, match=match):
        resolve_runner("auto", tmp_path)


def test_decoder_reranker_equals_transformers(qwen3_reranker_dir: Path) -> None:
    from transformers import Qwen3ForSequenceClassification

    ours = _load(qwen3_reranker_dir)
    assert ours.is_cross_encoder and resolve_runner("auto", qwen3_reranker_dir) == "pooling"
    ref = Qwen3ForSequenceClassification.from_pretrained(
        qwen3_reranker_dir, torch_dtype=torch.float32
    ).eval()
    pairs = [("what is a river", "the sea"), ("paris", "capital of france is paris")]
    encoded = [ours.tokenizer.backend.encode(a, b) for a, b in pairs]
    got = ours.classify([e.ids for e in encoded], [e.type_ids for e in encoded])
    for row, enc in zip(got, encoded, strict=True):
        with torch.no_grad():
            want = ref(torch.tensor([enc.ids])).logits[0]
        torch.testing.assert_close(row, want, atol=1e-5, rtol=1e-4)
