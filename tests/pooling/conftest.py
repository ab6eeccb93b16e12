"""Tiny random pooling checkpoints made by their producers: a sentence-transformers BERT
(mean pooling, normalized), a BERT cross-encoder, and a Qwen3 decoder body."""

from __future__ import annotations

from pathlib import Path

import pytest

WORDS = (
    "the a cat dog sat on mat is was red blue big small paris france capital city of "
    "what where who how many river sea sun moon one two three and or not"
).split()


def _tokenizer(root: Path):  # type: ignore[no-untyped-def]
    from transformers import BertTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *"abcdefghijklmnopqrstuvwxyz"]
    root.mkdir(parents=True, exist_ok=True)
    (root / "vocab.txt").write_text("\n".join(vocab) + "\n")
    return BertTokenizerFast(vocab_file=str(root / "vocab.txt")), len(vocab)


def _bert_config(vocab_size: int, **extra):  # type: ignore[no-untyped-def]
    from transformers import BertConfig

    return BertConfig(
        vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=128, **extra,
    )  # fmt: skip


@pytest.fixture(scope="session")
def st_bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from sentence_transformers import SentenceTransformer, models
    from transformers import BertModel

    torch.manual_seed(0)
    raw = tmp_path_factory.mktemp("bert-raw")
    tokenizer, vocab_size = _tokenizer(raw / "tok")
    BertModel(_bert_config(vocab_size)).save_pretrained(raw, safe_serialization=True)
    tokenizer.save_pretrained(raw)
    body = models.Transformer(str(raw))
    pooling = models.Pooling(32, pooling_mode="mean")
    out = tmp_path_factory.mktemp("bert-st")
    SentenceTransformer(modules=[body, pooling, models.Normalize()], device="cpu").save(str(out))
    return out


@pytest.fixture(scope="session")
def cross_encoder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import BertForSequenceClassification

    torch.manual_seed(1)
    out = tmp_path_factory.mktemp("bert-cross")
    tokenizer, vocab_size = _tokenizer(out / "tok")
    model = BertForSequenceClassification(_bert_config(vocab_size, num_labels=1))
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def qwen3_body_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(2)
    out = tmp_path_factory.mktemp("qwen3-body")
    tokenizer, vocab_size = _tokenizer(out / "tok")
    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        matryoshka_dimensions=[16, 32, 64],
    )  # fmt: skip
    config.architectures = ["Qwen3Model"]
    Qwen3Model(config).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def qwen3_reranker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A decoder reranker as converted Qwen3-Reranker checkpoints are: a sequence
    classification head (`score`) on a Qwen3 body."""
    import torch
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    torch.manual_seed(3)
    out = tmp_path_factory.mktemp("qwen3-reranker")
    tokenizer, vocab_size = _tokenizer(out / "tok")
    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        num_labels=1, pad_token_id=0,
    )  # fmt: skip
    Qwen3ForSequenceClassification(config).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
