"""The short way to a text-only streamed chunk gives the bytes the general path encodes."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from asyncserve.http.protocol import (
    ChatCompletionStreamResponse,
    ChatStreamChoice,
    CompletionStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
)
from asyncserve.http.sse import sse_event
from asyncserve.http.text_chunks import TextChunks

# An id and a model holding the split marks themselves: JSON escapes their quotes.
ID = 'cmpl-x"content":""y"text":""'
MODEL = 'm"content":""'
TEXTS = [" the", 'a "quoted" \\ word', "naïve 東京 🎉", "\n\t\u0000", '"content":"" "text":""']


def chat_chunk(index: int, text: str) -> bytes:
    choice = ChatStreamChoice(index=index, delta=DeltaMessage(content=text))
    return sse_event(
        ChatCompletionStreamResponse(
            id=ID, object="chat.completion.chunk", created=1, model=MODEL, choices=[choice]
        )
    )


def completion_chunk(index: int, text: str) -> bytes:
    choice = CompletionStreamChoice(index, text, None, None)
    return sse_event(
        CompletionStreamResponse(
            id=ID, object="text_completion", created=1, model=MODEL, choices=[choice]
        )
    )


@pytest.mark.parametrize(
    ("general", "field"), [(chat_chunk, "content"), (completion_chunk, "text")]
)
@pytest.mark.parametrize("index", [0, 3])
def test_text_chunk_matches_the_general_chunk(
    general: Callable[[int, str], bytes], field: str, index: int
) -> None:
    chunks = TextChunks(lambda i: general(i, ""), field)
    for text in TEXTS + TEXTS:  # the second round from the cached parts
        assert chunks(index, text) == general(index, text)
    event = json.loads(general(index, TEXTS[2]).removeprefix(b"data: "))
    assert event["choices"][0]["index"] == index
    assert event["choices"][0]["finish_reason"] is None


def test_a_template_without_the_field_is_refused() -> None:
    chunks = TextChunks(lambda i: b'data: {"other":""}\n\n', "text")
    with pytest.raises(ValueError):
        chunks(0, "x")
