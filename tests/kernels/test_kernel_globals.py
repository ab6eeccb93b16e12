"""Every Triton kernel reads only the globals Triton's compiler accepts.

A kernel that reads a plain Python number from its module runs under `TRITON_INTERPRET=1` (the
CPU tests) but fails to compile on a GPU ("Cannot access global variable ..."): this check finds
such a read without a GPU, with the rule Triton's code generator applies.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import symtable
import textwrap
from types import ModuleType

import pytest
import triton
import triton.language as tl
from triton.runtime.jit import KernelInterface

import asyncserve.kernels


def _kernels() -> list[tuple[str, KernelInterface]]:
    """The @triton.jit functions of asyncserve.kernels (interpreted ones on CPU)."""
    found: dict[int, tuple[str, KernelInterface]] = {}
    for info in pkgutil.iter_modules(asyncserve.kernels.__path__):
        module = importlib.import_module(f"asyncserve.kernels.{info.name}")
        for name, value in vars(module).items():
            fn = getattr(value, "fn", None)
            if (
                isinstance(value, KernelInterface)
                and getattr(fn, "__module__", None) == module.__name__
            ):
                found[id(value)] = (f"{info.name}.{name}", value)
    return sorted(found.values(), key=lambda item: item[0])


def _global_names(kernel: KernelInterface) -> set[str]:
    source = textwrap.dedent(inspect.getsource(kernel.fn))
    table = symtable.symtable(source, "<kernel>", "exec")
    (function,) = [
        child for child in table.get_children() if child.get_name() == kernel.fn.__name__
    ]
    return {symbol.get_name() for symbol in function.get_symbols() if symbol.is_global()}


def _allowed(value: object) -> bool:
    return (
        isinstance(value, (ModuleType, KernelInterface, tl.constexpr, tl.dtype))
        or getattr(value, "__triton_builtin__", False)
        or getattr(value, "__module__", "").startswith("triton.language")
    )


def test_the_kernels_are_found() -> None:
    names = [name for name, _ in _kernels()]
    assert "activation._act_and_mul_kernel" in names
    assert "attention_kernel._unified_attention_kernel" in names
    assert len(names) >= 20


@pytest.mark.parametrize("name,kernel", _kernels(), ids=lambda v: v if isinstance(v, str) else "")
def test_kernel_reads_only_compilable_globals(name: str, kernel: KernelInterface) -> None:
    bad = []
    for global_name in sorted(_global_names(kernel)):
        if global_name not in kernel.fn.__globals__:
            continue  # a builtin such as range or min
        if not _allowed(kernel.fn.__globals__[global_name]):
            bad.append(global_name)
    assert not bad, f"{name} reads non-constexpr globals {bad}: wrap them in tl.constexpr"


def test_the_check_finds_a_plain_number() -> None:
    assert not _allowed(0.5)
    assert _allowed(tl.constexpr(0.5))
    assert _allowed(triton)
