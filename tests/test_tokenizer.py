"""Tokenizer: equal to HF's GGUF tokenizer on SmolLM2; HF-directory and byte-level sources."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from asyncserve.models.gguf_loader import open_gguf
from asyncserve.tokenizer import GIL_FREE_DECODE_MIN_IDS, Tokenizer

TEXTS = [
    "Hello world",
    "  two  spaces   and\ttabs\n\nnewlines \n",
    "12345 3.14159 1,000,000 and 2024-11-21",
    "naïve café Ünïcödé — 日本語の文章 中文 Ελληνικά русский",
    "emoji 😀👍🏽 🇫🇷 👨‍👩‍👧",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "x<|endoftext|>y <repo_name>z",
    "def f(x):\n    return x**2  # comment\n",
    "",
    " ",
    "I'm sure they'll say we've DONE it",
    "\u00a0nbsp\u200bzero-width",
]


@pytest.fixture(scope="module")
def ours(gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(open_gguf(gguf_path).metadata)


@pytest.fixture(scope="module")
def theirs(hf_smollm2: Any) -> Any:
    return hf_smollm2[1]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_hf(ours: Tokenizer, theirs: Any, text: str) -> None:
    ids = ours.encode(text)
    assert ids == theirs.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)


def test_special_tokens(ours: Tokenizer) -> None:
    assert (ours.bos_token, ours.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (1, 2, 2)
    assert ours.special_token_ids == set(range(17))
    assert ours.vocab_size == 49152
    assert ours.add_bos_token is False
    assert ours.chat_template is not None


def test_chat_template_matches_hf(ours: Tokenizer, theirs: Any) -> None:
    conversations = [
        [{"role": "user", "content": "What is 2+2?"}],
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye"},
        ],
    ]
    for messages in conversations:
        for add in (True, False):
            expected = theirs.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add
            )
            assert ours.apply_chat_template(messages, add_generation_prompt=add) == expected


def test_unsupported_gguf_tokenizer_model() -> None:
    with pytest.raises(ValueError, match="unsupported GGUF tokenizer model 'llama'"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": []})


def test_from_dir_reads_config_and_jinja(ours: Tokenizer, tmp_path: Path) -> None:
    ours.backend.save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": {"content": "<|im_start|>", "special": True},
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": "{{ 'from config' }}",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_dir(tmp_path)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)
    assert tok.encode("Hello world") == ours.encode("Hello world")
    assert tok.apply_chat_template([]) == "from config"
    # chat_template.jinja beside it wins, as in HF.
    (tmp_path / "chat_template.jinja").write_text("{{ 'from jinja' }}")
    assert Tokenizer.from_dir(tmp_path).apply_chat_template([]) == "from jinja"


def test_from_dir_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(ValueError, match="cannot read"):
        Tokenizer.from_dir(tmp_path)


def test_no_chat_template_is_a_value_error() -> None:
    tok = Tokenizer.byte_level(300, None, [299])
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_byte_level_is_lossless_and_keeps_specials() -> None:
    tok = Tokenizer.byte_level(1000, 1, [2, 999])
    text = "Grüße 🌍\n\tend"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    # Bytes skip the special ids, which stay special.
    assert 1 not in ids and 2 not in ids
    assert tok.special_token_ids == {1, 2, 999}
    assert tok.decode([*ids, 2]) == text
    assert tok.decode([500]) == "<tok_500>"
    assert tok.vocab_size == 1000
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Tokenizer.byte_level(300, 300, [])
    with pytest.raises(ValueError, match="vocab_size"):
        Tokenizer.byte_level(257, 256, [0])


@pytest.mark.parametrize("text", ["a\ud800b", "\udc00", "ok \ud83d"])
def test_lone_surrogates_are_a_value_error(ours: Tokenizer, text: str) -> None:
    with pytest.raises(ValueError, match="lone surrogate .* at character"):
        ours.encode(text)
    with pytest.raises(ValueError, match="lone surrogate"):
        Tokenizer.byte_level(512, 256, [0]).encode(text)
    assert ours.encode("a\U0001f600b")  # a character past the BMP (a JSON surrogate pair)


def test_convert_ids_out_of_range(ours: Tokenizer) -> None:
    with pytest.raises(ValueError, match="out of range"):
        ours.convert_ids_to_tokens([10**6])


def _sleeps_beside(work: Any, seconds: float = 0.6) -> float:
    """Wall time of 300 GIL-releasing calls (time.sleep(0), as the step thread's torch ops
    release and retake it) made while another thread runs `work` over and over."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            work()

    worker = threading.Thread(target=loop)
    worker.start()
    try:
        time.sleep(0.05)
        start = time.perf_counter()
        for _ in range(300):
            time.sleep(0)
        return time.perf_counter() - start
    finally:
        stop.set()
        worker.join(seconds)


def test_long_texts_and_id_lists_leave_the_gil_to_other_threads(ours: Tokenizer) -> None:
    """A long prompt or id list tokenized in the preprocessing pool must not stall the step
    thread: each of its calls into the tokenizer runs without the GIL. Held, every GIL
    hand-off of the other thread waits for a whole call (milliseconds each: seconds here)."""
    text = "word " * 20_000
    ids = ours.encode(text)
    assert len(ids) > GIL_FREE_DECODE_MIN_IDS
    assert ours.decode(ids) == ours.backend.decode(ids)
    assert ours.decode(ids[:3]) == ours.backend.decode(ids[:3])
    for name, work in (("encode", lambda: ours.encode(text)), ("decode", lambda: ours.decode(ids))):
        elapsed = _sleeps_beside(work)
        assert elapsed < 1.0, f"{name}: 300 GIL hand-offs took {elapsed:.2f} s beside it"
