"""Cheap checks that keep a constraint from costing seconds to compile or to mask: a JSON
schema nested too deeply, a regex whose counted repetitions multiply out too far; and a
schema whose $refs loop on one value, or whose every value must hold another one of the
same schema (no finite value matches either)."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote

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


def check_regex(pattern: str, where: str = "structured_outputs.regex") -> None:
    size = regex_expansion(pattern)
    if size > MAX_REGEX_EXPANSION:
        raise ValueError(
            f"{where}: its repetitions expand to about {size} atoms; the "
            f"limit is {MAX_REGEX_EXPANSION}"
        )


def check_schema_patterns(schema: Any) -> None:
    """check_regex on every regex of a JSON schema (`pattern` values, `patternProperties`
    keys): llguidance compiles them lazily, so an explosive one would stall the first
    masks of every running request instead of failing here."""
    stack: list[tuple[Any, str]] = [(schema, "#")]
    while stack:
        node, pointer = stack.pop()
        if isinstance(node, list):
            stack.extend((value, f"{pointer}/{i}") for i, value in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        where = f"structured_outputs.json: invalid schema: the pattern at {pointer}"
        if isinstance(node.get("pattern"), str):
            check_regex(node["pattern"], where)
        if isinstance(node.get("patternProperties"), dict):
            for key in node["patternProperties"]:
                check_regex(key, f"{where}/patternProperties")
        for key, value in node.items():
            if key not in _DATA_KEYWORDS and isinstance(value, dict | list):
                stack.append((value, f"{pointer}/{_escape(str(key))}"))


def check_recursion(schema: Any, where: str = "structured_outputs.json") -> None:
    """ValueError naming `where` when no finite value matches `schema` for its recursion:
    a ref_cycle or an endless_chain (llguidance compiles both, then fails mid-output)."""
    cycle = ref_cycle(schema)
    if cycle is not None:
        raise ValueError(
            f"{where}: invalid schema: the $ref cycle {' -> '.join(cycle)} applies to the "
            "same value forever (no value matches)"
        )
    chain = endless_chain(schema)
    if chain is not None:
        raise ValueError(
            f"{where}: invalid schema: every value must hold another of the same schema "
            f"({' -> '.join(chain)}), so no finite value matches"
        )


# Keywords whose values are data, not schemas: a {"$ref"} inside them is not a reference.
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})


def ref_cycle(schema: Any) -> list[str] | None:
    """A chain of local `$ref` / `allOf` links that comes back to where it started, as
    JSON pointers ("#/$defs/a", ...), or None. Such a chain applies a schema to the same
    value forever (JSON Schema's infinite regress): no value matches, and a grammar built
    from it dead-ends mid-output. Recursion through properties or items: endless_chain."""
    nodes = _schema_nodes(schema)

    def links(pointer: str) -> list[str]:
        return [p for p in _same_value_links(nodes, pointer) if p in nodes]

    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in nodes:
        if start in state:
            continue
        path = [start]
        todo = [iter(links(start))]
        state[start] = 1
        while todo:
            nxt = next(todo[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                todo.pop()
            elif state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                todo.append(iter(links(nxt)))
    return None


def endless_chain(schema: Any) -> list[str] | None:
    """For a schema whose every value must contain another value of the same schema (an
    object property that is required, the items of a non-empty array: no finite value
    matches), a chain of JSON pointers from the root back into such a loop; else None.
    llguidance compiles these, then fails mid-output. Optional recursion, an `anyOf` branch
    that ends, or a type that lets a value skip the requirement (no "type": "object") is
    fine; pure $ref loops are ref_cycle's."""
    nodes = _schema_nodes(schema)
    if "#" not in nodes:
        return None
    # A node matches a finite value once every one of its groups has a branch that does.
    groups = {pointer: _requirements(nodes, pointer) for pointer in nodes}
    open_groups = {pointer: len(g) for pointer, g in groups.items()}
    users: dict[str, list[tuple[str, int]]] = {}
    for pointer, node_groups in groups.items():
        for i, group in enumerate(node_groups):
            for target in group:
                users.setdefault(target, []).append((pointer, i))
    done: set[tuple[str, int]] = set()  # groups with a branch that matches
    finite = [pointer for pointer, count in open_groups.items() if count == 0]
    matched = set(finite)
    while finite:
        target = finite.pop()
        for pointer, i in users.get(target, ()):
            if (pointer, i) in done:
                continue
            done.add((pointer, i))
            open_groups[pointer] -= 1
            if open_groups[pointer] == 0 and pointer not in matched:
                matched.add(pointer)
                finite.append(pointer)
    if "#" in matched:
        return None
    # Every node left needs one that is left too: follow the first until one repeats.
    chain = ["#"]
    seen = {"#"}
    while True:
        pointer = chain[-1]
        group = next(g for i, g in enumerate(groups[pointer]) if (pointer, i) not in done)
        chain.append(group[0])
        if group[0] in seen:
            return chain
        seen.add(group[0])


def _schema_nodes(schema: Any) -> dict[str, dict[str, Any]]:
    """Every schema object in `schema` by its JSON pointer ("#", "#/properties/a", ...)."""
    nodes: dict[str, dict[str, Any]] = {}
    stack: list[tuple[Any, str]] = [(schema, "#")]
    while stack:
        node, pointer = stack.pop()
        if isinstance(node, dict):
            nodes[pointer] = node
            for key, value in node.items():
                if key not in _DATA_KEYWORDS and isinstance(value, dict | list):
                    stack.append((value, f"{pointer}/{_escape(str(key))}"))
        elif isinstance(node, list):
            stack.extend((value, f"{pointer}/{i}") for i, value in enumerate(node))
    return nodes


def _same_value_links(nodes: dict[str, dict[str, Any]], pointer: str) -> list[str]:
    """The schemas that apply to the same value as the one at `pointer`: its local $ref
    and its allOf members."""
    node = nodes[pointer]
    out = []
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out.append("#" + unquote(ref[1:]).rstrip("/") if ref != "#/" else "#")
    all_of = node.get("allOf")
    if isinstance(all_of, list):
        out.extend(f"{pointer}/allOf/{i}" for i in range(len(all_of)))
    return out


def _requirements(nodes: dict[str, dict[str, Any]], pointer: str) -> list[list[str]]:
    """What a value of the schema at `pointer` needs, as groups of schemas: one schema of
    each group must match (the value itself or a part it must have). A group naming
    something that is not a schema object here (true, a remote $ref) always holds."""
    node = nodes[pointer]
    groups = [[target] for target in _same_value_links(nodes, pointer)]
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list):
            groups.append([f"{pointer}/{key}/{i}" for i in range(len(node[key]))])
    kind = node.get("type")
    if kind == "object" or kind == ["object"]:
        properties = node.get("properties")
        required = node.get("required")
        if isinstance(properties, dict) and isinstance(required, list):
            groups.extend(
                [f"{pointer}/properties/{_escape(name)}"]
                for name in required
                if isinstance(name, str) and name in properties
            )
    elif kind == "array" or kind == ["array"]:
        min_items = node.get("minItems")
        count = min_items if isinstance(min_items, int) else 0
        prefix = node.get("prefixItems")
        prefix = prefix if isinstance(prefix, list) else []
        groups.extend([f"{pointer}/prefixItems/{i}"] for i in range(min(count, len(prefix))))
        if count > len(prefix) and isinstance(node.get("items"), dict):
            groups.append([f"{pointer}/items"])
    return [group for group in groups if group and all(p in nodes for p in group)]


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")
