"""A tolerant scanner for JSON that may still be arriving: where a value ends (or that it
has not ended yet), and the fields of an object seen so far, as raw spans of the text.

Tool-call parsers stream a call's arguments as the model's own text; raw spans (rather than
re-serialized values) keep every streamed fragment a prefix of the final arguments.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_WS = " \t\n\r"
_NUMBER = "+-0123456789.eE"
_LITERALS = ("true", "false", "null")


class JSONScanError(ValueError):
    """The text cannot be (the start of) JSON."""


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def scan_string(text: str, i: int) -> int | None:
    """End (exclusive) of the string starting at text[i] == '"'; None if it has not ended."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def scan_value(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON value starting at text[i]; None while it is incomplete.

    A number that reaches the end of the text counts as incomplete: more digits may come."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return scan_string(text, i)
    if c in "{[":
        return _scan_container(text, i)
    if c in _NUMBER:
        j = i
        while j < len(text) and text[j] in _NUMBER:
            j += 1
        return j if j < len(text) else None
    for literal in _LITERALS:
        if literal.startswith(text[i : i + len(literal)]):
            return i + len(literal) if text.startswith(literal, i) else None
    raise JSONScanError(f"unexpected {c!r} at offset {i}")


def _scan_container(text: str, i: int) -> int | None:
    depth = 0
    j = i
    while j < len(text):
        c = text[j]
        if c == '"':
            end = scan_string(text, j)
            if end is None:
                return None
            j = end
            continue
        if c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return None


@dataclass
class Span:
    start: int
    end: int
    complete: bool


@dataclass
class PartialObject:
    """An object's fields so far (key -> raw value span); `end` once the object closed."""

    fields: dict[str, Span]
    end: int | None


def scan_object(text: str, i: int) -> PartialObject:
    """The fields of the object starting at text[i] == '{', as far as the text goes."""
    if i >= len(text) or text[i] != "{":
        raise JSONScanError(f"expected an object at offset {i}")
    fields: dict[str, Span] = {}
    j = skip_ws(text, i + 1)
    while j < len(text):
        if text[j] == "}":
            return PartialObject(fields, j + 1)
        if text[j] != '"':
            raise JSONScanError(f"expected a key at offset {j}")
        key_end = scan_string(text, j)
        if key_end is None:
            break
        key = json.loads(text[j:key_end])
        j = skip_ws(text, key_end)
        if j >= len(text):
            break
        if text[j] != ":":
            raise JSONScanError(f"expected ':' at offset {j}")
        start = skip_ws(text, j + 1)
        if start >= len(text):
            break
        end = scan_value(text, start)
        if end is None:
            fields[key] = Span(start, len(text), False)
            break
        fields[key] = Span(start, end, True)
        j = skip_ws(text, end)
        if j < len(text):
            if text[j] == ",":
                j = skip_ws(text, j + 1)
            elif text[j] != "}":
                raise JSONScanError(f"expected ',' or '}}' at offset {j}")
    return PartialObject(fields, None)


def array_elements(text: str, i: int) -> tuple[list[int], int | None]:
    """Start offsets of the elements of the array at text[i] == '[' seen so far, and the
    array's end once it closed. Elements are not checked beyond finding where they end."""
    if i >= len(text) or text[i] != "[":
        raise JSONScanError(f"expected an array at offset {i}")
    starts: list[int] = []
    j = skip_ws(text, i + 1)
    if j < len(text) and text[j] == "]":
        return starts, j + 1
    while j < len(text):
        starts.append(j)
        end = scan_value(text, j)
        if end is None:
            return starts, None
        j = skip_ws(text, end)
        if j >= len(text):
            return starts, None
        if text[j] == "]":
            return starts, j + 1
        if text[j] != ",":
            raise JSONScanError(f"expected ',' or ']' at offset {j}")
        j = skip_ws(text, j + 1)
    return starts, None
