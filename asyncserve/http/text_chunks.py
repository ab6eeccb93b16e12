"""Streamed chunks that carry only text, as bytes around the text's JSON string.

Most chunks of a stream differ from each other in one string: the token step's text (no
finish reason, logprobs, token ids, tool calls or usage). Each such chunk is the general
chunk's encoding with that string spliced in, so it is cut from the general path's own
bytes once per choice and then costs one string encoding per token instead of building
and encoding three or four msgspec Structs.
"""

from __future__ import annotations

from collections.abc import Callable

from asyncserve.http.sse import encode_json


class TextChunks:
    """`chunks(index, text)`: the SSE event `template(index)` encodes, with `text` in the
    string field `field` (which `template` leaves empty)."""

    def __init__(self, template: Callable[[int], bytes], field: str) -> None:
        self._template = template
        self._mark = encode_json(field) + b':""'
        self._parts: dict[int, tuple[bytes, bytes]] = {}

    def __call__(self, index: int, text: str) -> bytes:
        parts = self._parts.get(index)
        if parts is None:
            # Quotes inside JSON strings are escaped, so the mark only occurs as the field
            # itself; a template where it occurs twice is a bug in the caller.
            head, tail = self._template(index).split(self._mark)
            parts = self._parts[index] = (head + self._mark[:-2], tail)
        return parts[0] + encode_json(text) + parts[1]
