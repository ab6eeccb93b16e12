"""One Triton compile in a forked child process, which leaves the kernel in Triton's disk
cache: the caller's own compile after it is a cache hit.

Start-up compiles run on a thread pool (parallel_compiles.py), but Triton's compiler builds
each kernel's IR in Python, under the GIL, so sixteen threads compile about twice as fast
as one. A child forked from the thread has its own interpreter: the compiles overlap fully.
Forking needs no pickling (the child holds the parent's kernel objects and the compile
closure as they are) and no start-up (its modules are imported). The child touches no CUDA
(the target is given, nothing launches or loads) and runs only the compiler, which the
parent's threads run only after a child failed: cache hits and kernel loads stay in the
parent. A lock another thread held at the fork would never be released in the child: the
kernels' hash locks are made anew there, and a child stuck past CHILD_TIMEOUT_S is killed.
The child also builds the kernel's launcher (a C module Triton caches on disk too).

A child that fails leaves nothing behind; the caller's compile then runs in-process as
before and raises the compiler's own error.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
# A compile that outlasts this is taken for a stuck child: killed, the thread compiles.
CHILD_TIMEOUT_S = 300.0
_warnings_lock = threading.Lock()
_warnings_filtered = False


def fork_available() -> bool:
    """ASYNCSERVE_COMPILE_FORK (default 1): start-up compiles in forked children; 0 keeps
    them on the threads. Needs os.fork (not on Windows)."""
    text = os.environ.get("ASYNCSERVE_COMPILE_FORK", "1").strip()
    if text not in ("0", "1"):
        raise ValueError(f"ASYNCSERVE_COMPILE_FORK must be 0 or 1, got {text!r}")
    return text == "1" and hasattr(os, "fork")


def compile_in_child(compile_fn: Callable[[], Any]) -> bool:
    """Run `compile_fn` (a Triton compile into its disk cache) in a forked child and wait for
    it; True when it succeeded. Call from a thread that does nothing else meanwhile."""
    _filter_fork_warning()
    try:
        pid = os.fork()
    except OSError as error:
        logger.debug("cannot fork a compiler: %r", error)
        return False
    if pid == 0:
        _child(compile_fn)  # never returns
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status) == 0
        if time.monotonic() > deadline:
            logger.warning("a kernel compile in a child ran past %.0f s: killed", CHILD_TIMEOUT_S)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return False
        time.sleep(0.005)


def _filter_fork_warning() -> None:
    """Python 3.12 warns of forking a threaded process; this child only compiles. (One
    filter for good: warnings.catch_warnings is not thread-safe.)"""
    global _warnings_filtered
    with _warnings_lock:
        if not _warnings_filtered:
            warnings.filterwarnings(
                "ignore",
                message=r".*use of fork\(\) may lead to deadlocks",
                category=DeprecationWarning,
            )
            _warnings_filtered = True


def _child(compile_fn: Callable[[], Any]) -> None:
    code = 1
    try:
        _die_with_parent()
        _reset_hash_locks(compile_fn)
        kernel = compile_fn()
        code = 0
        _build_launcher(kernel)
    except BaseException:  # noqa: BLE001 - the parent's own compile reports it
        pass
    finally:
        os._exit(code)  # no atexit, no flushing of the parent's buffers, no CUDA teardown


def _reset_hash_locks(root: Any, depth: int = 4) -> None:
    """Give the kernels the compile reaches fresh hash locks: another thread of the parent
    may have held one at the fork, and it would never be released here. Walks the compile
    closure's cells, a Triton source's kernel and constexprs (Triton's JITFunction keeps a
    `_hash_lock` RLock; nothing else of the compile locks)."""
    if depth == 0 or root is None:
        return
    if hasattr(root, "_hash_lock"):
        root._hash_lock = threading.RLock()
    for cell in getattr(root, "__closure__", None) or ():
        try:
            _reset_hash_locks(cell.cell_contents, depth - 1)
        except ValueError:  # an empty cell
            continue
    if hasattr(root, "fn") and hasattr(root, "constants"):  # an ASTSource
        _reset_hash_locks(root.fn, depth - 1)
        for value in dict(root.constants).values():
            _reset_hash_locks(value, depth - 1)


def _die_with_parent() -> None:
    """A parent killed mid start-up takes its compilers with it (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _build_launcher(kernel: Any) -> None:
    """Triton versions with a C launcher per signature compile it on first load: do that
    here, into the disk cache, so the parent's load only opens it. Best effort."""
    try:
        from triton.runtime.driver import driver

        driver.active.launcher_cls(kernel.src, kernel.metadata)
    except Exception:  # noqa: BLE001 - the parent builds it then
        pass
