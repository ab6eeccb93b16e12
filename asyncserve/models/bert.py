"""BERT-family encoders (BertModel, BertForSequenceClassification) for pooling.

Bidirectional attention over a padded batch with no KV cache: an encoder reads each input
once, so there is nothing to page. Post-LayerNorm blocks, learned absolute positions and
token types, GELU, as in the original BERT and the sentence-transformers checkpoints.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ENCODER_ARCHITECTURES = ("BertModel", "BertForSequenceClassification", "BertForMaskedLM")
_ACTIVATIONS = {"gelu": lambda x: F.gelu(x), "gelu_new": lambda x: F.gelu(x, approximate="tanh")}


@dataclass(frozen=True)
class BertConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    num_labels: int

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> BertConfig:
        arch = (d.get("architectures") or ["BertModel"])[0]
        if d.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(
                f"position_embedding_type {d['position_embedding_type']!r} is not supported "
                "(only 'absolute')"
            )
        act = d.get("hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported for BERT models")
        labels = d.get("id2label")
        return cls(
            architecture=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=int(d["num_attention_heads"]),
            intermediate_size=int(d["intermediate_size"]),
            max_position_embeddings=int(d.get("max_position_embeddings", 512)),
            type_vocab_size=int(d.get("type_vocab_size", 2)),
            layer_norm_eps=float(d.get("layer_norm_eps", 1e-12)),
            hidden_act=act,
            num_labels=int(d.get("num_labels", len(labels) if labels else 1)),
        )


class _Layer(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        h = c.hidden_size
        self.heads = c.num_attention_heads
        self.query, self.key, self.value = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=c.layer_norm_eps)
        self.up = nn.Linear(h, c.intermediate_size)
        self.down = nn.Linear(c.intermediate_size, h)
        self.out_norm = nn.LayerNorm(h, eps=c.layer_norm_eps)
        self.act = _ACTIVATIONS[c.hidden_act]

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        d = h // self.heads

        def split(p: torch.Tensor) -> torch.Tensor:
            return p.view(b, t, self.heads, d).transpose(1, 2)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1 / math.sqrt(d))
        x = self.attn_norm(x + self.attn_out(attn.transpose(1, 2).reshape(b, t, h)))
        return self.out_norm(x + self.down(self.act(self.up(x))))


class BertEncoder(nn.Module):
    """forward(input_ids [B, T], token_type_ids [B, T], lengths [B]) -> hidden [B, T, H];
    classify(hidden) -> [B, num_labels] logits (sequence-classification checkpoints)."""

    # HF name fragment -> this module's name fragment.
    _RENAMES = (
        ("embeddings.LayerNorm.", "embed_norm."),
        ("embeddings.word_embeddings.", "word_embeddings."),
        ("embeddings.position_embeddings.", "position_embeddings."),
        ("embeddings.token_type_embeddings.", "token_type_embeddings."),
        ("encoder.layer.", "layers."),
        (".attention.self.query.", ".query."),
        (".attention.self.key.", ".key."),
        (".attention.self.value.", ".value."),
        (".attention.output.dense.", ".attn_out."),
        (".attention.output.LayerNorm.", ".attn_norm."),
        (".intermediate.dense.", ".up."),
        (".output.dense.", ".down."),
        (".output.LayerNorm.", ".out_norm."),
        ("pooler.dense.", "pooler."),
    )

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, h)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, h)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, h)
        self.embed_norm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(_Layer(config) for _ in range(config.num_hidden_layers))
        self.is_classifier = config.architecture == "BertForSequenceClassification"
        if self.is_classifier:
            self.pooler = nn.Linear(h, h)
            self.classifier = nn.Linear(h, config.num_labels)

    def forward(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        b, t = input_ids.shape
        positions = torch.arange(t, device=input_ids.device)
        x = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(positions)[None]
            + self.token_type_embeddings(token_type_ids)
        )
        x = self.embed_norm(x)
        # Keys past a sequence's length are padding: masked out for every query.
        valid = positions[None, :] < lengths[:, None]
        mask = valid[:, None, None, :]
        for layer in self.layers:
            x = layer(x, mask)
        return x

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits from the [CLS] position, through BERT's tanh pooler."""
        return self.classifier(torch.tanh(self.pooler(hidden[:, 0])))

    def checkpoint_slice(self, hf_name: str) -> None:
        """Every tensor is read whole (no tensor parallelism for encoders)."""
        return None

    def checkpoint_skips(self, hf_name: str) -> bool:
        return False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        filled: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("bert.")
            if name.startswith(("cls.", "embeddings.position_ids")) or "position_ids" in name:
                continue  # the masked-LM head and buffers are not used for pooling
            if name.startswith("pooler.") and not self.is_classifier:
                continue  # sentence embeddings do not use the pooler
            for old, new in self._RENAMES:
                name = name.replace(old, new)
            param = params.get(name)
            if param is None:
                raise ValueError(f"unexpected tensor {hf_name!r} in a BERT checkpoint")
            if param.shape != tensor.shape:
                raise ValueError(
                    f"{hf_name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(tensor)
            filled.add(name)
        missing = sorted(set(params) - filled)
        if missing:
            raise ValueError(f"BERT checkpoint is missing {missing[:5]}")
        return filled
