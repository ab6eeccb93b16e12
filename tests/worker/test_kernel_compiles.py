"""The compile watch: Triton's JIT hooks, timed; after start-up, logged and counted."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from asyncserve.worker.kernel_compiles import CompileWatch


@pytest.fixture(autouse=True)
def _triton_hooks_restored() -> Iterator[None]:
    """Each test's watch hooks into Triton's process-wide knobs: put them back after."""
    triton = pytest.importorskip("triton")
    knobs = triton.knobs.runtime
    saved = (knobs.jit_cache_hook, knobs.jit_post_compile_hook)
    yield
    knobs.jit_cache_hook, knobs.jit_post_compile_hook = saved


def _compile(watch: CompileWatch, name: str, key: str) -> None:
    fn = SimpleNamespace(name=name)
    assert watch.before_compile(key=key, fn=fn, repr="", compile={}) is None
    watch.after_compile(key=key, fn=fn, repr="", compile={})


def test_compiles_count_only_after_start_up(caplog: pytest.LogCaptureFixture) -> None:
    watch = CompileWatch()
    _compile(watch, "_kernel_at_start", "k1")
    assert watch.compiles_after_start == 0
    watch.arm()
    assert watch.armed
    with caplog.at_level(logging.WARNING, logger="asyncserve.worker.kernel_compiles"):
        _compile(watch, "_attention_kernel", "('i32', 'D')")
    assert watch.compiles_after_start == 1
    assert "_attention_kernel compiled after start-up" in caplog.text
    assert "('i32', 'D')" in caplog.text
    watch.disarm()
    _compile(watch, "_another", "k2")
    assert watch.compiles_after_start == 1


def test_earlier_hooks_still_decide() -> None:
    """A hook set before ours is still called, and its answer (skip the compile) kept."""
    import triton

    knobs = triton.knobs.runtime
    calls: list[str] = []

    def earlier(**kwargs: object) -> bool:
        calls.append("before")
        return True

    knobs.jit_cache_hook = earlier
    knobs.jit_post_compile_hook = None
    watch = CompileWatch()
    assert watch.install() and knobs.jit_cache_hook == watch.before_compile
    fn = SimpleNamespace(name="k")
    assert watch.before_compile(key="x", fn=fn) is True
    assert watch.after_compile(key="x", fn=fn) is None
    assert calls == ["before"]
