from __future__ import annotations

import pytest

from asyncserve.core.grammar_limits import check_regex, json_depth, regex_expansion


@pytest.mark.parametrize(
    ("pattern", "size"),
    [
        ("(a{1000}){1000}", 1_000_000),
        ("(a{100}){100}", 10_000),
        (r"[a-z]{3,10}@x\.com", 16),
        (r"\d{4}-\d{2}", 7),
        ("a{2,}", 2),
        ("[]a]{3}", 3),
        ("a{}", 3),
    ],
)
def test_regex_expansion(pattern: str, size: int) -> None:
    assert regex_expansion(pattern) == size


def test_check_regex_names_the_limit() -> None:
    check_regex("(a{100}){100}")
    with pytest.raises(ValueError, match="the limit is 10000"):
        check_regex("(a{1000}){1000}")


def test_json_depth_skips_strings() -> None:
    assert json_depth('{"a": "[[[[", "b": [[1]]}') == 3
    assert json_depth("[" * 500 + "]" * 500) == 500
