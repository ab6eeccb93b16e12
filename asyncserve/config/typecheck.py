"""Declared types checked at run time: a configuration built from Python (LLM(...),
EngineConfig.from_engine_args) gets a one-line ValueError naming the argument or field and the
type it takes, before anything loads, instead of a TypeError (or a silent coercion) later.

Rules: a bool is only True or False; an int is no bool and no float; a float also takes an
int. A Literal is held to its values' type here, its values being checked where the field is.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import inspect
import reprlib
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar, Union, cast, get_args, get_origin

F = TypeVar("F", bound=Callable[..., Any])

_NAMES: dict[Any, str] = {
    bool: "a bool",
    int: "an int",
    float: "a number",
    str: "a string",
    type(None): "None",
    dict: "a dict",
    collections.abc.Mapping: "a dict",
    list: "a list",
    collections.abc.Sequence: "a list",
    tuple: "a tuple",
}


_HINTS: dict[Any, dict[str, Any]] = {}


def _hints(owner: Any) -> dict[str, Any]:
    if owner not in _HINTS:
        _HINTS[owner] = typing.get_type_hints(owner, include_extras=True)
    return _HINTS[owner]


def _is_union(origin: Any) -> bool:
    return origin is Union or origin is types.UnionType


def _matches(value: Any, hint: Any) -> bool:
    if hint is Any or isinstance(hint, TypeVar):
        return True
    if hint is None or hint is type(None):
        return value is None
    origin = get_origin(hint)
    args = get_args(hint)
    if _is_union(origin):
        return any(_matches(value, h) for h in args)
    if origin is Annotated:
        return _matches(value, args[0])
    if origin is Literal:
        return any(_matches(value, type(v)) for v in args)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin is not None:
        return _matches_container(value, origin, args)
    return not isinstance(hint, type) or isinstance(value, hint)


def _matches_container(value: Any, origin: Any, args: tuple[Any, ...]) -> bool:
    if not isinstance(origin, type):
        return True  # a typing construct this check does not model
    if not isinstance(value, origin):
        return False
    if not args or not issubclass(origin, collections.abc.Iterable):
        return True
    if isinstance(value, collections.abc.Mapping):
        key, item = args if len(args) == 2 else (Any, Any)
        return all(_matches(k, key) and _matches(v, item) for k, v in value.items())
    if isinstance(value, tuple) and not (len(args) == 2 and args[1] is Ellipsis):
        return len(value) == len(args) and all(map(_matches, value, args))
    if isinstance(value, (str, bytes)):
        return True
    return all(_matches(v, args[0]) for v in cast(collections.abc.Iterable[Any], value))


def describe(hint: Any) -> str:
    """A type as an error message names it: "an int or None"."""
    origin = get_origin(hint)
    args = get_args(hint)
    if _is_union(origin):
        parts = [describe(h) for h in args if h is not type(None)]
        if type(None) in args:
            parts.append("None")
        return " or ".join(dict.fromkeys(parts))
    if origin is Annotated:
        return describe(args[0])
    if origin is Literal:
        return " or ".join(dict.fromkeys(describe(type(v)) for v in args))
    base = origin if origin is not None else hint
    return _NAMES.get(base) or f"a {getattr(base, '__name__', str(base))}"


def check_value(name: str, value: Any, hint: Any) -> None:
    if not _matches(value, hint):
        shown = reprlib.repr(value).replace("\n", " ")
        raise ValueError(f"{name} must be {describe(hint)}, got {shown} ({type(value).__name__})")


def check_fields(instance: Any) -> None:
    """Every field of a dataclass instance against its declared type."""
    hints = _hints(type(instance))
    for field in dataclasses.fields(instance):
        check_value(field.name, getattr(instance, field.name), hints[field.name])


def typed_arguments(func: F) -> F:
    """The arguments a call gives, checked against the function's annotations."""
    signature = inspect.signature(func)

    @functools.wraps(func)
    def checked(*args: Any, **kwargs: Any) -> Any:
        hints = _hints(func)
        for name, value in signature.bind(*args, **kwargs).arguments.items():
            if name in hints:
                check_value(name, value, hints[name])
        return func(*args, **kwargs)

    return cast(F, checked)
