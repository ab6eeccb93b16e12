from __future__ import annotations

import pytest

from asyncserve.core.grammar_limits import (
    check_regex,
    endless_chain,
    json_depth,
    ref_cycle,
    regex_expansion,
)


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


@pytest.mark.parametrize(
    ("schema", "cycle"),
    [
        ({"$ref": "#"}, ["#", "#"]),
        ({"allOf": [{"$ref": "#"}]}, ["#", "#/allOf/0", "#"]),
        ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, ["#/$defs/a", "#/$defs/a"]),
        ({"$defs": {"a/b": {"$ref": "#/$defs/a~1b"}}}, ["#/$defs/a~1b", "#/$defs/a~1b"]),
        ({"$defs": {"a b": {"$ref": "#/$defs/a%20b"}}}, ["#/$defs/a b", "#/$defs/a b"]),
        # Recursion through properties or items descends into a smaller value: fine.
        ({"type": "object", "properties": {"next": {"$ref": "#"}}}, None),
        ({"type": "array", "items": {"$ref": "#"}}, None),
        ({"anyOf": [{"type": "null"}, {"type": "array", "items": {"$ref": "#"}}]}, None),
        # Data is not schema; dangling refs are left to the compiler.
        ({"const": {"$ref": "#"}, "enum": [{"$ref": "#"}]}, None),
        ({"$ref": "#/$defs/missing"}, None),
        (True, None),
    ],
)  # fmt: skip
def test_ref_cycles(schema: object, cycle: list[str] | None) -> None:
    assert ref_cycle(schema) == cycle


NODE = {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}


@pytest.mark.parametrize(
    ("schema", "chain"),
    [
        ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
         ["#", "#/properties/a", "#"]),
        ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, ["#", "#/items", "#"]),
        ({"type": "array", "prefixItems": [{"$ref": "#"}], "minItems": 1},
         ["#", "#/prefixItems/0", "#"]),
        ({"type": "object", "required": ["a"],
          "properties": {"a": {"anyOf": [{"$ref": "#"}, {"allOf": [{"$ref": "#"}]}]}}},
         ["#", "#/properties/a", "#/properties/a/anyOf/0", "#"]),
        ({"$defs": {"n": NODE}, "type": "object", "properties": {"root": {"$ref": "#/$defs/n"}},
          "required": ["root"]},
         ["#", "#/properties/root", "#/$defs/n", "#/$defs/n/properties/next", "#/$defs/n"]),
        # A way out: the property optional, a branch that ends, a value that need not be an
        # object (or array), an empty array, a loop the root does not need.
        ({"type": "object", "properties": {"a": {"$ref": "#"}}}, None),
        ({"type": "object", "properties": {"a": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
          "required": ["a"]}, None),
        ({"properties": {"a": {"$ref": "#"}}, "required": ["a"]}, None),
        ({"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
         None),
        ({"type": "array", "items": {"$ref": "#"}}, None),
        ({"$defs": {"n": NODE}, "type": "object", "properties": {"root": {"$ref": "#/$defs/n"}}},
         None),
        ({"type": "object", "properties": {"a": {"anyOf": [{"$ref": "#"}, True]}},
          "required": ["a"]}, None),
        (True, None),
    ],
)  # fmt: skip
def test_endless_chains(schema: object, chain: list[str] | None) -> None:
    assert endless_chain(schema) == chain
