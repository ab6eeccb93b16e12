"""Tokenizer: a `tokenizers.Tokenizer` plus the special-token facts the engine needs.

Three sources: an HF directory (tokenizer.json + tokenizer_config.json), GGUF metadata
(byte-level BPE rebuilt from the vocabulary and merges), and a byte-level placeholder for
dummy-weight models that ship no tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from asyncserve.chat_template import render_chat_template

# Above this many ids decode goes through decode_batch, which releases the GIL (see decode).
GIL_FREE_DECODE_MIN_IDS = 256
# GGUF token_type values (llama.cpp's llama_token_type).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# Split regexes for GGUF `tokenizer.ggml.pre` values whose merges were learned on a split
# other than GPT-2's; any other value gets GPT-2's (as transformers' GGUF converter does).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


class Tokenizer:
    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str | None = None,
        add_bos_token: bool | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.bos_token_id = self._id_of(bos_token, "bos_token")
        self.eos_token_id = self._id_of(eos_token, "eos_token")
        self.pad_token_id = self._id_of(pad_token, "pad_token")
        self.special_token_ids: set[int] = {
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        }
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        if add_bos_token is None:
            # Whatever the backend's post-processor does is what encode() does.
            probe = backend.encode("a", add_special_tokens=True).ids
            add_bos_token = self.bos_token_id is not None and probe[:1] == [self.bos_token_id]
        self.add_bos_token = add_bos_token

    def _id_of(self, token: str | None, field: str) -> int | None:
        if token is None:
            return None
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{field} {token!r} is not in the vocabulary")
        return int(token_id)

    # -- text <-> ids ------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text must be a string, got {type(text).__name__}")
        # encode_batch, not encode: only it lets go of the GIL while the tokenizer runs, and a
        # long prompt holding it for milliseconds per call stalls the step thread's every
        # torch op behind it (decode steps 100x slower while a batch of prompts tokenizes).
        try:
            (encoding,) = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)
        except TypeError:
            # The tokenizer refuses a str that is not valid Unicode (a lone surrogate, as
            # "\ud800" makes in Python) with a TypeError: the caller's error, named.
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(
                    f"text is not valid Unicode: lone surrogate {text[exc.start]!r} at "
                    f"character {exc.start}"
                ) from None
            raise
        ids: list[int] = encoding.ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        if len(ids) > GIL_FREE_DECODE_MIN_IDS:
            # As in encode: decode_batch lets go of the GIL while it runs (a long /detokenize
            # body holds it for milliseconds otherwise); a stream's few ids decode faster
            # through decode.
            (text,) = self.backend.decode_batch([ids], skip_special_tokens=skip_special_tokens)
            return str(text)
        return str(self.backend.decode(ids, skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        out = []
        for i in ids:
            token = self.backend.id_to_token(i)
            if token is None:
                raise ValueError(f"token id {i} is out of range (vocab_size {self.vocab_size})")
            out.append(token)
        return out

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        template = kwargs.pop("chat_template", None) or self.chat_template
        if template is None:
            raise ValueError(
                "this model has no chat template; pass chat_template or use completions"
            )
        return render_chat_template(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            tools=tools,
            **kwargs,
        )

    # -- constructors ------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """From an HF directory: tokenizer.json, tokenizer_config.json, chat_template.jinja."""
        root = Path(path)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise ValueError(f"no tokenizer.json in {root}")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust side raises a bare Exception on bad JSON
            raise ValueError(f"cannot read {tok_file}: {e}") from e
        config = _read_json(root / "tokenizer_config.json")
        special_map = _read_json(root / "special_tokens_map.json")

        def token(name: str) -> str | None:
            value = config.get(name, special_map.get(name))
            if isinstance(value, dict):  # serialized AddedToken
                value = value.get("content")
            return value if isinstance(value, str) else None

        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        jinja_file = root / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        add_bos = config.get("add_bos_token")
        return cls(
            backend,
            bos_token=token("bos_token"),
            eos_token=token("eos_token"),
            pad_token=token("pad_token"),
            chat_template=template if isinstance(template, str) else None,
            add_bos_token=add_bos if isinstance(add_bos, bool) else None,
        )

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """From a GGUF file's metadata (keys as llama.cpp writes them: tokenizer.ggml.*)."""
        kind = metadata.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"unsupported GGUF tokenizer model {kind!r}; supported: 'gpt2' (byte-level BPE)"
            )
        tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
        merges_raw: list[str] = list(metadata.get("tokenizer.ggml.merges") or [])
        token_types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or [])
        alphabet = set(bytes_to_unicode().values())
        byte_map = bytes_to_unicode()
        # Tokens are stored in the byte alphabet; one that is not (a raw string) is re-spelled.
        vocab = {
            (t if set(t) <= alphabet else "".join(byte_map[b] for b in t.encode("utf-8"))): i
            for i, t in enumerate(tokens)
        }
        merges = []
        for m in merges_raw:
            parts = m.split(" ")
            if len(parts) != 2:
                raise ValueError(f"tokenizer.ggml.merges: malformed merge {m!r}")
            merges.append((parts[0], parts[1]))
        backend = tokenizers.Tokenizer(
            models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
        )
        split = _PRE_SPLITS.get(str(metadata.get("tokenizer.ggml.pre")))
        if split is None:
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        else:
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(split), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        backend.decoder = decoders.ByteLevel()
        # Control tokens (<|im_start|> ...) are matched whole in text and are special; a
        # "control" token spelled outside the byte alphabet is a llama.cpp mislabel, skipped.
        specials = [
            AddedToken(t, special=True, normalized=False)
            for t, kind_ in zip(tokens, token_types, strict=False)
            if kind_ == _TOKEN_CONTROL and set(t) <= alphabet
        ]
        user = [
            AddedToken(t, special=False, normalized=False)
            for t, kind_ in zip(tokens, token_types, strict=False)
            if kind_ == _TOKEN_USER_DEFINED and t in vocab
        ]
        backend.add_special_tokens(specials)
        backend.add_tokens(user)

        def token_at(key: str) -> str | None:
            token_id = metadata.get(key)
            if token_id is None:
                return None
            if not 0 <= int(token_id) < len(tokens):
                raise ValueError(f"{key} {token_id} is outside the vocabulary")
            return tokens[int(token_id)]

        bos = token_at("tokenizer.ggml.bos_token_id")
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
        if add_bos and bos is not None:
            bos_id = vocab[bos]
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
            )
        template = metadata.get("tokenizer.chat_template")
        return cls(
            backend,
            bos_token=bos,
            eos_token=token_at("tokenizer.ggml.eos_token_id"),
            pad_token=token_at("tokenizer.ggml.padding_token_id"),
            chat_template=template if isinstance(template, str) else None,
            add_bos_token=add_bos,
        )

    @classmethod
    def byte_level(
        cls, vocab_size: int, bos_token_id: int | None, eos_token_ids: Sequence[int]
    ) -> Tokenizer:
        """A real, lossless tokenizer for models that ship none (dummy weights).

        The 256 bytes take the lowest ids not used by bos/eos (ids 0..255 when the special
        ids lie above): UTF-8 text encodes to one id per byte and decodes back exactly. Every
        other id is a placeholder spelled "<tok_N>" that decodes to that literal text, so
        anything a random model samples can be detokenized. The bos and eos ids are special
        tokens (dropped by decode(skip_special_tokens=True)).
        """
        special_ids = list(
            dict.fromkeys(i for i in [bos_token_id, *eos_token_ids] if i is not None)
        )
        for i in special_ids:
            if not 0 <= i < vocab_size:
                raise ValueError(f"special token id {i} is outside the vocabulary ({vocab_size})")
        if vocab_size < 256 + len(special_ids):
            raise ValueError(
                f"vocab_size must be >= {256 + len(special_ids)} for a byte-level tokenizer, "
                f"got {vocab_size}"
            )
        byte_map = bytes_to_unicode()
        byte_ids = [i for i in range(256 + len(special_ids)) if i not in special_ids][:256]
        vocab = {byte_map[b]: i for b, i in enumerate(byte_ids)}
        taken = set(byte_ids)
        names = {i: f"<tok_{i}>" for i in range(vocab_size) if i not in taken}
        vocab.update({name: i for i, name in names.items()})
        backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens(
            [AddedToken(names[i], special=True, normalized=False) for i in special_ids]
        )
        return cls(
            backend,
            bos_token=names[bos_token_id] if bos_token_id is not None else None,
            eos_token=names[eos_token_ids[0]] if eos_token_ids else None,
            add_bos_token=False,
        )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data
