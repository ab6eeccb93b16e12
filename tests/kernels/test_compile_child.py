"""compile_child: a compile run in a forked child, its result told by the exit status."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from asyncserve.kernels import compile_child
from asyncserve.kernels.compile_child import compile_in_child, fork_available

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def test_the_child_writes_what_the_parent_reads(tmp_path: Path) -> None:
    out = tmp_path / "kernel.bin"
    assert compile_in_child(lambda: out.write_bytes(b"cubin"))
    assert out.read_bytes() == b"cubin"


def test_a_failing_compile_is_false() -> None:
    def broken() -> None:
        raise RuntimeError("ptxas failed")

    assert not compile_in_child(broken)


def test_a_hash_lock_held_by_another_thread_at_the_fork_does_not_stall_the_child(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(compile_child, "CHILD_TIMEOUT_S", 10.0)  # a stalled child: False

    class Kernel:  # as Triton's JITFunction: an RLock around its cache key
        def __init__(self) -> None:
            self._hash_lock = threading.RLock()

    kernel = Kernel()
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with kernel._hash_lock:
            held.set()
            release.wait()

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait()

    def compile_kernel() -> None:
        with kernel._hash_lock:  # never released in the child without the reset
            pass

    try:
        assert compile_in_child(lambda: compile_kernel())
    finally:
        release.set()
        holder.join()


def test_a_stuck_child_is_killed_at_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compile_child, "CHILD_TIMEOUT_S", 0.5)
    start = time.monotonic()
    assert not compile_in_child(lambda: time.sleep(60))
    assert time.monotonic() - start < 10


def test_fork_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ASYNCSERVE_COMPILE_FORK", raising=False)
    assert fork_available()
    monkeypatch.setenv("ASYNCSERVE_COMPILE_FORK", "0")
    assert not fork_available()
    monkeypatch.setenv("ASYNCSERVE_COMPILE_FORK", "yes")
    with pytest.raises(ValueError, match="ASYNCSERVE_COMPILE_FORK must be 0 or 1"):
        fork_available()
