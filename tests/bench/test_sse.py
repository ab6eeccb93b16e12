"""SSE framing and chunk decoding of the bench client (asyncserve/bench/sse.py)."""

from __future__ import annotations

import msgspec
import pytest

from asyncserve.bench.sse import DONE, SSEReader, decode_chunk

TOKEN = b'{"id":"c","choices":[{"index":0,"text":" the","finish_reason":null}]}'
USAGE = b'{"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}'
STREAM = (
    b": keep-alive\n\n"
    + b"data: " + TOKEN + b"\n\n"
    + b": keep-alive\n\n"
    + b"data: " + TOKEN + b"\n\n"
    + b"data: " + USAGE + b"\n\n"
    + b"data: [DONE]\n\n"
)  # fmt: skip


def test_whole_stream_in_one_read() -> None:
    assert SSEReader().feed(STREAM) == [TOKEN, TOKEN, USAGE, DONE]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 50])
def test_stream_split_across_reads(size: int) -> None:
    reader = SSEReader()
    payloads = []
    for i in range(0, len(STREAM), size):
        payloads += reader.feed(STREAM[i : i + size])
    assert payloads == [TOKEN, TOKEN, USAGE, DONE]


def test_every_split_point() -> None:
    for cut in range(len(STREAM) + 1):
        reader = SSEReader()
        assert reader.feed(STREAM[:cut]) + reader.feed(STREAM[cut:]) == [
            TOKEN,
            TOKEN,
            USAGE,
            DONE,
        ], cut


def test_incomplete_event_waits_for_its_end() -> None:
    reader = SSEReader()
    assert reader.feed(b"data: " + TOKEN + b"\n") == []
    assert reader.feed(b"\n") == [TOKEN]


def test_crlf_framing_split_between_cr_and_lf() -> None:
    reader = SSEReader()
    assert reader.feed(b"data: a\r\n\r") == []
    assert reader.feed(b"\ndata: b\r\n\r\n") == [b"a", b"b"]


def test_multiline_data_and_named_events() -> None:
    reader = SSEReader()
    text = b"event: x\ndata: one\ndata:two\nid: 4\n\n: only a comment\n\n"
    assert reader.feed(text) == [b"one\ntwo"]


def test_decode_token_and_usage_chunks() -> None:
    token = decode_chunk(TOKEN)
    assert token.choices and token.usage is None and token.error is None
    usage = decode_chunk(USAGE)
    assert not usage.choices
    assert usage.usage is not None and usage.usage.completion_tokens == 2


def test_decode_empty_text_still_has_choices() -> None:
    # A server without a tokenizer streams empty text: the event still counts as output.
    chunk = decode_chunk(b'{"choices":[{"index":0,"text":""}],"usage":null}')
    assert chunk.choices and chunk.usage is None


def test_decode_error_event() -> None:
    chunk = decode_chunk(b'{"error":{"message":"boom","code":500}}')
    assert chunk.error == {"message": "boom", "code": 500}


def test_decode_rejects_garbage() -> None:
    with pytest.raises(msgspec.DecodeError):
        decode_chunk(b"{not json")
