"""Cheap checks that keep a constraint from costing seconds to compile or to mask: a JSON
schema nested too deeply, a regex whose counted repetitions multiply out too far."""

from __future__ import annotations

import re

# Deeper schemas given as text would exhaust json.loads' recursion (a RecursionError).
MAX_SCHEMA_DEPTH = 128
# A regex is rejected when its counted repetitions expand it to more than this many atoms:
# (a{1000}){1000} (10^6) took seconds per mask; (a{100}){100} (10^4) takes milliseconds.
MAX_REGEX_EXPANSION = 10_000

_COUNT = re.compile(r"\{(\d*)(?:(,)(\d*))?\}")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)


def json_depth(text: str) -> int:
    """The deepest bracket nesting outside strings (a cheap pre-check before json.loads)."""
    depth = deepest = 0
    for char in _STRING.sub("", text):
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def regex_expansion(pattern: str) -> int:
    """About how many atoms `pattern` has once its {m,n} counts are expanded (nested
    counts multiply); `*` and `+` count once, as the automaton loops on them."""
    stack = [0]
    last = 1  # size of the last atom or group, which a following {m,n} repeats
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            last, i = 1, i + 2
            stack[-1] += 1
        elif char == "[":
            end = i + 1
            while end < len(pattern) and (pattern[end] != "]" or end == i + 1):
                end += 2 if pattern[end] == "\\" else 1
            last, i = 1, end + 1
            stack[-1] += 1
        elif char == "(":
            stack.append(0)
            i += 1
        elif char == ")" and len(stack) > 1:
            last = stack.pop()
            stack[-1] += last
            i += 1
        elif (match := _COUNT.match(pattern, i)) is not None and match.group(0) != "{}":
            low, comma, high = match.groups()
            times = int(high) if high else int(low or 0)
            if comma and not high:
                times = max(times, 1)
            stack[-1] += last * (times - 1)
            last *= max(times, 1)
            i = match.end()
        elif char in "|*+?^$":
            i += 1
        else:
            last = 1
            stack[-1] += 1
            i += 1
    return sum(stack)


def check_regex(pattern: str) -> None:
    size = regex_expansion(pattern)
    if size > MAX_REGEX_EXPANSION:
        raise ValueError(
            f"structured_outputs.regex: its repetitions expand to about {size} atoms; the "
            f"limit is {MAX_REGEX_EXPANSION}"
        )
