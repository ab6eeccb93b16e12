"""Client side of server-sent events for `bench serve`: split a byte stream into events and
decode only what the benchmark needs from each one.

The reader works on whatever bytes one socket read delivered (they may hold several events,
or part of one), so the per-event cost is a split and one msgspec decode into a small Struct
that skips every field it does not name.
"""

from __future__ import annotations

from typing import Any

import msgspec

DONE = b"[DONE]"


class SSEReader:
    """Accumulates bytes; `feed` returns the `data:` payloads of the events completed so far.

    Comment lines (`: keep-alive`) and events without data give nothing. Several `data:` lines
    in one event are joined with a newline, as the SSE spec says.
    """

    __slots__ = ("_tail",)

    def __init__(self) -> None:
        self._tail = b""

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._tail + data if self._tail else data
        if b"\r" in buf:
            # CRLF framing is legal SSE; a lone trailing CR waits in the tail for its LF.
            buf = buf.replace(b"\r\n", b"\n")
        events = buf.split(b"\n\n")
        self._tail = events.pop()
        payloads = []
        for event in events:
            if event.startswith(b"data: ") and b"\n" not in event:
                payloads.append(event[6:])  # the common case: one data line
                continue
            lines = [line[5:] for line in event.split(b"\n") if line.startswith(b"data:")]
            if lines:
                payloads.append(b"\n".join(x[1:] if x.startswith(b" ") else x for x in lines))
        return payloads


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class StreamChunk(msgspec.Struct):
    """The parts of an OpenAI streaming completion chunk that the benchmark reads.

    Choices stay raw: whether there are any is all that matters (a server without a
    tokenizer sends empty text, and vLLM's client times those events too).
    """

    choices: list[msgspec.Raw] | None = None
    usage: _Usage | None = None
    error: Any = None  # an error event mid-stream; its shape varies by server


_decoder = msgspec.json.Decoder(StreamChunk)


def decode_chunk(payload: bytes) -> StreamChunk:
    return _decoder.decode(payload)
