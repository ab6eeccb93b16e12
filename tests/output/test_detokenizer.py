"""Incremental detokenizer on the real SmolLM2 tokenizer: streaming equals a full decode,
no split characters, stop strings never leak, special tokens as HF decodes them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
from tokenizers import Tokenizer

from asyncserve.models.gguf_loader import open_gguf
from asyncserve.output.detokenizer import IncrementalDetokenizer, decode_token
from asyncserve.sampling_params import SamplingParams
from asyncserve.tokenizer import Tokenizer as AsyncserveTokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog. It was not amused!",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "東京は日本の首都です。人口は約1400万人です。",
    "안녕하세요, 만나서 반갑습니다.",
    "Emoji: 👋🏽 🎉🎉 👨‍👩‍👧‍👦 🇫🇷 ❤️ done",
    "Crème brûlée, naïve façade, Ångström, São Paulo, Dvořák, e\u0301 (combining)",
    "Mixed: résumé 日本語 😀 code `x = {'a': 1}` — “quotes” … end",
    "مرحبا بالعالم и привет мир",
    "  leading spaces,\ttabs\n\n\nand   runs   of   spaces  ",
    "∑_{i=1}^{n} i² = n(n+1)/2 ≈ ∞ ∂x ∇ ≠ ≤",
]
CHATML = "<|im_start|>assistant\nHello there!<|im_end|>\n<|im_start|>user\nHi 😀<|im_end|>"


@pytest.fixture(scope="session")
def tokenizer(gguf_path: Path) -> Tokenizer:
    """The GGUF's tokenizer as the loader builds it (tests/test_tokenizer.py checks it
    against HF transformers' conversion of the same file)."""
    metadata = open_gguf(gguf_path).metadata
    return AsyncserveTokenizer.from_gguf_metadata(metadata).backend


@pytest.fixture(scope="session")
def special_ids(tokenizer: Tokenizer) -> set[int]:
    return {i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special}


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False).ids
    return ids


def token_id(tokenizer: Tokenizer, token: str) -> int:
    tid = tokenizer.token_to_id(token)
    assert tid is not None, token
    return int(tid)


def stream(
    tokenizer: Tokenizer,
    special_ids: set[int],
    ids: list[int],
    params: SamplingParams,
    prompt: list[int] | None = None,
    chunk: int = 1,
    stop_terminated: bool = False,
) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    """Feed ids `chunk` at a time as the engine does; return the deltas a client would see.

    After every step, what has been sent must be a prefix of the final text: a stop string
    that later truncates the text can never have leaked.
    """
    detok = IncrementalDetokenizer(tokenizer, prompt or [], params, special_ids)
    deltas: list[str] = []
    stop = None
    for start in range(0, len(ids), chunk):
        last = start + chunk >= len(ids)
        stop = detok.update(ids[start : start + chunk], stop_terminated and last)
        finished = stop is not None or last
        deltas.append(detok.get_next_output_text(finished, delta=True))
        assert detok.output_text.startswith("".join(deltas))
        if stop is not None:
            break
    assert "".join(deltas) == detok.output_text
    return detok, deltas, stop


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_streaming_equals_full_decode(
    tokenizer: Tokenizer, special_ids: set[int], text: str, chunk: int
) -> None:
    ids = encode(tokenizer, text)
    prompt = encode(tokenizer, "Please write something:\n")
    detok, deltas, stop = stream(tokenizer, special_ids, ids, SamplingParams(), prompt, chunk)
    assert stop is None
    assert detok.output_text == tokenizer.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    assert detok.num_output_tokens == len(ids)


def test_emoji_split_over_byte_tokens_never_shows_replacement_char(
    tokenizer: Tokenizer, special_ids: set[int]
) -> None:
    text = "🎉👨‍👩‍👧👋🏽"
    ids = encode(tokenizer, text)
    # The premise: some tokens here are partial UTF-8 sequences on their own.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(), special_ids)
    for token in ids:
        detok.update([token], False)
        assert "\ufffd" not in detok.output_text
        assert text.startswith(detok.output_text)
    assert detok.output_text == text


def test_invalid_bytes_mid_text_come_out_as_a_full_decode_does(
    tokenizer: Tokenizer, special_ids: set[int]
) -> None:
    # A lone partial emoji token followed by ordinary text: not a split character but
    # garbage the model produced, which decode shows as U+FFFD.
    partial = next(i for i in encode(tokenizer, "🎉") if "\ufffd" in tokenizer.decode([i]))
    ids = [*encode(tokenizer, "a"), partial, *encode(tokenizer, " and more text")]
    detok, _, _ = stream(tokenizer, special_ids, ids, SamplingParams())
    assert detok.output_text == tokenizer.decode(ids)


def test_invalid_bytes_before_an_added_token(tokenizer: Tokenizer, special_ids: set[int]) -> None:
    partial = next(i for i in encode(tokenizer, "🎉") if "\ufffd" in tokenizer.decode([i]))
    im_end = token_id(tokenizer, "<|im_end|>")
    ids = [*encode(tokenizer, "a"), partial, im_end, *encode(tokenizer, "b")]
    params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False)
    detok, _, _ = stream(tokenizer, special_ids, ids, params)
    assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=False)
    assert detok.output_text == "a\ufffd<|im_end|>b"


class RecordingTokenizer:
    """Passes calls through to a real tokenizer, noting how many ids each decode gets."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.decode_lengths: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decode_lengths.append(len(ids))
        text: str = self.inner.decode(ids, skip_special_tokens=skip_special_tokens)
        return text

    def get_added_tokens_decoder(self) -> dict[int, Any]:
        added: dict[int, Any] = self.inner.get_added_tokens_decoder()
        return added


def test_decode_window_stays_small(tokenizer: Tokenizer, special_ids: set[int]) -> None:
    """Each step decodes a few tokens, not the whole output (which would be quadratic)."""
    ids = encode(tokenizer, " ".join(TEXTS[:3]) * 3)
    assert len(ids) > 200
    recorder = RecordingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(cast(Tokenizer, recorder), [], SamplingParams(), special_ids)
    for token in ids:
        detok.update([token], False)
    assert detok.output_text == tokenizer.decode(ids)
    assert max(recorder.decode_lengths) <= 8


def test_prompt_context_does_not_leak_into_output(
    tokenizer: Tokenizer, special_ids: set[int]
) -> None:
    prompt = encode(tokenizer, "Once upon a time")
    ids = encode(tokenizer, " there was a king.")
    detok, _, _ = stream(tokenizer, special_ids, ids, SamplingParams(), prompt)
    assert detok.output_text == " there was a king."


TEXT = "The capital of France is Paris. It is a big city, and Paris is old."


@pytest.mark.parametrize("chunk", [1, 2, 100])
def test_stop_string_truncates_and_never_leaks(
    tokenizer: Tokenizer, special_ids: set[int], chunk: int
) -> None:
    ids = encode(tokenizer, TEXT)
    params = SamplingParams(stop=["Paris"])
    detok, deltas, stop = stream(tokenizer, special_ids, ids, params, chunk=chunk)
    assert stop == "Paris"
    assert detok.output_text == "The capital of France is "
    assert "P" not in "".join(deltas)


def test_stop_string_included_in_output(tokenizer: Tokenizer, special_ids: set[int]) -> None:
    ids = encode(tokenizer, TEXT)
    params = SamplingParams(stop=["Paris"], include_stop_str_in_output=True)
    # Several tokens in one update: text after the stop string is cut off.
    detok, _, stop = stream(tokenizer, special_ids, ids, params, chunk=100)
    assert stop == "Paris"
    assert detok.output_text == "The capital of France is Paris"


def test_stop_string_spanning_tokens(tokenizer: Tokenizer, special_ids: set[int]) -> None:
    ids = encode(tokenizer, TEXT)
    stop_str = "ance is Pa"
    # The premise: no single token holds the whole stop string.
    assert all(stop_str not in tokenizer.decode([i]) for i in ids)
    detok, deltas, stop = stream(tokenizer, special_ids, ids, SamplingParams(stop=[stop_str]))
    assert stop == stop_str
    assert detok.output_text == "The capital of Fr"
    # A partial match ("ance is") was held back until it could no longer be a prefix.
    assert "".join(deltas) == "The capital of Fr"


def test_earliest_of_several_stop_strings_wins(tokenizer: Tokenizer, special_ids: set[int]) -> None:
    ids = encode(tokenizer, TEXT)
    params = SamplingParams(stop=["big city", "It is", "zzz"])
    detok, deltas, stop = stream(tokenizer, special_ids, ids, params, chunk=100)
    assert stop == "It is"
    assert detok.output_text == "The capital of France is Paris. "
    params = SamplingParams(stop=["old", "city"])
    detok, _, stop = stream(tokenizer, special_ids, ids, params, chunk=1)
    assert stop == "city"
    assert detok.output_text == "The capital of France is Paris. It is a big "


def test_hold_back_while_streaming(tokenizer: Tokenizer, special_ids: set[int]) -> None:
    ids = encode(tokenizer, "Hello world, this goes on")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["STOP!"]), special_ids)
    detok.update(ids, False)
    assert detok.output_text == "Hello world, this goes on"
    # Cumulative and delta views hold back len("STOP!") - 1 characters until finished.
    assert detok.get_next_output_text(False, delta=False) == "Hello world, this goe"
    assert detok.get_next_output_text(False, delta=True) == "Hello world, this goe"
    assert detok.get_next_output_text(False, delta=True) == ""
    assert detok.get_next_output_text(True, delta=True) == "s on"
    assert detok.get_next_output_text(True, delta=False) == "Hello world, this goes on"


@pytest.mark.parametrize("chunk", [1, 100])
def test_min_tokens_ignores_early_stop_strings(
    tokenizer: Tokenizer, special_ids: set[int], chunk: int
) -> None:
    ids = encode(tokenizer, "Paris is lovely, Paris in spring.")
    first = encode(tokenizer, "Paris")
    params = SamplingParams(stop=["Paris"], min_tokens=len(first))
    detok, _, stop = stream(tokenizer, special_ids, ids, params, chunk=chunk)
    assert stop == "Paris"
    assert detok.output_text == "Paris is lovely, "


def test_stop_token_text_is_left_out(tokenizer: Tokenizer, special_ids: set[int]) -> None:
    im_end = token_id(tokenizer, "<|im_end|>")
    ids = [*encode(tokenizer, "All done."), im_end]
    params = SamplingParams(skip_special_tokens=False)
    detok, _, stop = stream(tokenizer, special_ids, ids, params, stop_terminated=True)
    assert stop is None
    assert detok.output_text == "All done."
    assert detok.num_output_tokens == len(ids)
    # An ordinary token used as a stop id is left out the same way.
    period = encode(tokenizer, "All done.")
    detok, _, _ = stream(tokenizer, special_ids, period, SamplingParams(), stop_terminated=True)
    assert detok.output_text == tokenizer.decode(period[:-1])
    params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True)
    detok, _, _ = stream(tokenizer, special_ids, ids, params, stop_terminated=True)
    assert detok.output_text == "All done. <|im_end|>"


def hf_slow_decode(
    tokenizer: Tokenizer, ids: list[int], skip_special: bool, spaces_between: bool
) -> str:
    """HF's slow-tokenizer decode: added tokens are segments of their own, joined by a space
    when spaces_between_special_tokens."""
    added = tokenizer.get_added_tokens_decoder()
    segments: list[str] = []
    run: list[int] = []
    for token in ids:
        if token in added:
            if skip_special and added[token].special:
                continue
            if run:
                segments.append(tokenizer.decode(run))
                run = []
            segments.append(added[token].content)
        else:
            run.append(token)
    if run:
        segments.append(tokenizer.decode(run))
    return (" " if spaces_between else "").join(segments)


@pytest.mark.parametrize("skip_special", [True, False])
@pytest.mark.parametrize("spaces_between", [True, False])
def test_special_tokens(
    tokenizer: Tokenizer, special_ids: set[int], skip_special: bool, spaces_between: bool
) -> None:
    ids = encode(tokenizer, CHATML)
    assert token_id(tokenizer, "<|im_start|>") in ids  # parsed as special tokens
    params = SamplingParams(
        skip_special_tokens=skip_special, spaces_between_special_tokens=spaces_between
    )
    prompt = encode(tokenizer, "<|im_start|>system\nBe brief.<|im_end|>\n")
    detok, deltas, _ = stream(tokenizer, special_ids, ids, params, prompt)
    assert detok.output_text == hf_slow_decode(tokenizer, ids, skip_special, spaces_between)
    assert not any("\ufffd" in d for d in deltas)
    if skip_special:
        assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=True)
        assert detok.output_text == "assistant\nHello there!\nuser\nHi 😀"
    elif spaces_between:
        assert detok.output_text == (
            "<|im_start|> assistant\nHello there! <|im_end|> \n <|im_start|> user\nHi 😀 <|im_end|>"
        )
    else:
        assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=False) == CHATML


def test_decode_token(tokenizer: Tokenizer) -> None:
    paris = encode(tokenizer, " Paris")
    assert len(paris) == 1
    assert decode_token(tokenizer, paris[0]) == " Paris"
    assert decode_token(tokenizer, token_id(tokenizer, "<|im_end|>")) == "<|im_end|>"
