"""A pooling model on one device: a BERT encoder or a decoder body, its tokenizer, its pooler.

Decoders run through the same model code as generation, each batch with a scratch KV cache
of its own (prefill only: nothing is kept between batches); encoders run bidirectionally on a
padded batch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from asyncserve.config import ModelConfig
from asyncserve.models.arch_config import ArchConfig
from asyncserve.models.attention import AttentionMetadata
from asyncserve.models.base import CausalLM
from asyncserve.models.bert import ENCODER_ARCHITECTURES, BertConfig, BertEncoder
from asyncserve.models.loader import (
    _build_model,
    _iter_safetensors,
    _load_tokenizer,
    _read_json,
    _safetensors_files,
    default_model_path,
    init_dummy_weights,
    resolve_dtype,
)
from asyncserve.models.parallel import SINGLE
from asyncserve.pooling.config import DECODER_BODIES, PoolerConfig, pooler_config
from asyncserve.tokenizer import Tokenizer
from asyncserve.worker.kv_pool import allocate_kv_caches

logger = logging.getLogger(__name__)
_BLOCK = 16


class PoolingModel:
    def __init__(
        self,
        model: CausalLM | BertEncoder,
        tokenizer: Tokenizer,
        pooler: PoolerConfig,
        hidden_size: int,
        max_model_len: int,
        model_path: str,
        arch: ArchConfig | None,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.pooler = pooler
        self.hidden_size = hidden_size
        self.max_model_len = max_model_len
        self.model_path = model_path
        self.arch = arch  # decoders only
        self.device = device
        self.dtype = dtype
        self.is_encoder = isinstance(model, BertEncoder)
        # A decoder reranker's classification head (`score`, on the last token), if any.
        self.score_head: torch.nn.Linear | None = None
        self.is_cross_encoder = isinstance(model, BertEncoder) and model.is_classifier

    @property
    def vocab_size(self) -> int:
        if isinstance(self.model, BertEncoder):
            return self.model.config.vocab_size
        assert self.arch is not None
        return self.arch.vocab_size

    @classmethod
    def load(cls, config: ModelConfig, device: torch.device) -> PoolingModel:
        path = Path(config.model) if config.model is not None else Path(default_model_path())
        if not (path / "config.json").is_file():
            raise ValueError(f"a pooling model must be an HF directory with a config.json: {path}")
        hf = _read_json(path / "config.json")
        arch_name = (hf.get("architectures") or [""])[0]
        dtype = resolve_dtype(config.dtype, str(hf.get("torch_dtype") or "float32"), device)
        if arch_name in ENCODER_ARCHITECTURES:
            bert = BertConfig.from_hf_dict(hf)
            with torch.device(device):
                encoder = BertEncoder(bert).to(dtype).eval()
            if config.load_format == "dummy":
                init_dummy_weights(encoder, config.seed)
            else:
                encoder.load_weights(_iter_safetensors(_safetensors_files(path), device, encoder))  # type: ignore[arg-type]
            tokenizer = Tokenizer.from_dir(config.tokenizer or path)
            max_len = min(
                config.max_model_len or bert.max_position_embeddings, bert.max_position_embeddings
            )
            return cls(encoder, tokenizer, pooler_config(path, hf, True), bert.hidden_size,
                       max_len, str(path), None, device, dtype)  # fmt: skip
        # A decoder: the generation model without its LM head (never used for pooling); a
        # *ForSequenceClassification checkpoint (a converted reranker such as Qwen3-Reranker)
        # adds a `score` head read on the last token.
        classifier = arch_name.endswith("ForSequenceClassification")
        body = arch_name.replace("ForSequenceClassification", "ForCausalLM")
        hf = {**hf, "architectures": [DECODER_BODIES.get(body, body)]}
        hf["tie_word_embeddings"] = True
        arch = ArchConfig.from_hf_dict(hf)
        decoder = _build_model(arch, device, dtype, SINGLE)
        head: torch.nn.Linear | None = None
        if classifier:
            labels = hf.get("id2label")
            num_labels = int(hf.get("num_labels", len(labels) if labels else 2))
            with torch.device(device):
                head = torch.nn.Linear(arch.hidden_size, num_labels, bias=False).to(dtype)
        if config.load_format == "dummy":
            init_dummy_weights(decoder, config.seed)
            if head is not None:
                init_dummy_weights(head, config.seed)
        else:
            weights = _iter_safetensors(_safetensors_files(path), device, decoder)
            heads_read: list[str] = []
            decoder.load_weights(_decoder_weights(weights, head, heads_read))
            if head is not None and not heads_read:
                raise ValueError(f"{arch_name} checkpoint has no score.weight: {path}")
        tokenizer = _load_tokenizer(config, path, None, arch)
        max_len = min(
            config.max_model_len or arch.max_position_embeddings, arch.max_position_embeddings
        )
        pooling = cls(decoder, tokenizer, pooler_config(path, hf, False), arch.hidden_size,
                      max_len, str(path), arch, device, dtype)  # fmt: skip
        if head is not None:
            pooling.score_head = head.eval()
            pooling.is_cross_encoder = True
        return pooling

    # ---- forward ---------------------------------------------------------------------------

    @torch.inference_mode()
    def hidden_states(
        self, batch: list[list[int]], token_types: list[list[int]] | None = None
    ) -> list[torch.Tensor]:
        """Each sequence's final hidden states, [len_i, hidden]."""
        if self.is_encoder:
            hidden, _ = self._encode(batch, token_types)
            return [hidden[i, : len(ids)] for i, ids in enumerate(batch)]
        return self._decode(batch)

    @torch.inference_mode()
    def pool(self, batch: list[list[int]]) -> torch.Tensor:
        """One float32 vector per sequence, [B, hidden], normalized if the model says so."""
        pooled = []
        kind = self.pooler.pooling_type
        for states in self.hidden_states(batch):
            vec = states[0] if kind == "CLS" else states[-1] if kind == "LAST" else states.mean(0)
            pooled.append(vec.float())
        out = torch.stack(pooled)
        return F.normalize(out, dim=-1) if self.pooler.normalize else out

    @torch.inference_mode()
    def classify(self, batch: list[list[int]], token_types: list[list[int]]) -> torch.Tensor:
        """A cross-encoder's logits, [B, num_labels] float32 (a decoder reranker reads its
        head on each sequence's last token; token types are BERT's only)."""
        if self.score_head is not None:
            last = torch.stack([states[-1] for states in self._decode(batch)])
            return self.score_head(last).float()
        assert isinstance(self.model, BertEncoder) and self.model.is_classifier
        hidden, _ = self._encode(batch, token_types)
        return self.model.classify(hidden).float()

    def _encode(
        self, batch: list[list[int]], token_types: list[list[int]] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert isinstance(self.model, BertEncoder)
        width = max(len(ids) for ids in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.int64)
        types = torch.zeros(len(batch), width, dtype=torch.int64)
        for i, seq in enumerate(batch):
            ids[i, : len(seq)] = torch.tensor(seq)
            if token_types is not None:
                types[i, : len(seq)] = torch.tensor(token_types[i])
        lengths = torch.tensor([len(s) for s in batch])
        dev = self.device
        return self.model(ids.to(dev), types.to(dev), lengths.to(dev)), lengths

    def _decode(self, batch: list[list[int]]) -> list[torch.Tensor]:
        assert self.arch is not None and not isinstance(self.model, BertEncoder)
        dev = self.device
        blocks = [-(-len(ids) // _BLOCK) for ids in batch]
        caches = allocate_kv_caches(self.arch, sum(blocks), _BLOCK, self.dtype, dev)
        tables = torch.zeros(len(batch), max(blocks), dtype=torch.int32)
        slots, positions, cu = [], [], [0]
        first = 0
        for i, ids in enumerate(batch):
            tables[i, : blocks[i]] = torch.arange(first, first + blocks[i])
            slots.append(torch.arange(len(ids)) + first * _BLOCK)
            positions.append(torch.arange(len(ids)))
            cu.append(cu[-1] + len(ids))
            first += blocks[i]
        lens = [len(ids) for ids in batch]
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slots).to(dev),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            block_tables=tables.to(dev),
            max_seqlen_q=max(lens),
            max_seqlen_k=max(lens),
        )
        flat = torch.tensor([t for ids in batch for t in ids], dtype=torch.int64, device=dev)
        hidden = self.model(flat, torch.cat(positions).to(dev), caches, meta)
        return [hidden[cu[i] : cu[i + 1]] for i in range(len(batch))]


def _decoder_weights(
    weights: Iterator[tuple[str, torch.Tensor]],
    head: torch.nn.Linear | None = None,
    heads_read: list[str] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """A decoder body's tensors under the generation model's names (`model.` prefix); its
    LM head, if the checkpoint has one, is not needed; `score.weight` fills `head`."""
    for name, tensor in weights:
        if name.startswith("lm_head."):
            continue
        if name == "score.weight" and head is not None:
            if tuple(tensor.shape) != tuple(head.weight.shape):
                raise ValueError(
                    f"score.weight: checkpoint shape {tuple(tensor.shape)} != "
                    f"{tuple(head.weight.shape)}"
                )
            with torch.no_grad():
                head.weight.copy_(tensor)
            if heads_read is not None:
                heads_read.append(name)
            continue
        yield (name if name.startswith("model.") else "model." + name), tensor
