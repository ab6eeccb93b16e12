"""Running one offline call (LLM.generate, beam_search, embed, ...) on the LLM's event loop."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

# One lock per LLM's loop: calls from several threads take turns on it (the loop runs on
# one thread at a time, and its tasks may not be created from another while it runs).
_locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, threading.Lock] = (
    weakref.WeakKeyDictionary()
)
_locks_guard = threading.Lock()


def _lock_of(loop: asyncio.AbstractEventLoop) -> threading.Lock:
    with _locks_guard:
        lock = _locks.get(loop)
        if lock is None:
            lock = _locks[loop] = threading.Lock()
        return lock


def _running_here() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def run_call(loop: asyncio.AbstractEventLoop, call: Coroutine[Any, Any, T]) -> T:
    """Run `call` to completion, after any call another thread is running on `loop`. When
    the wait is interrupted (Ctrl-C is a KeyboardInterrupt raised out of the loop, not into
    the call), the call is cancelled and run until its requests are aborted: left pending,
    they would keep their KV blocks and run on in the next call."""
    if _running_here() is loop:  # a call from inside another (from a progress callback)
        call.close()
        raise RuntimeError("an LLM runs one call at a time: it was called from inside another")
    with _lock_of(loop):
        if loop.is_closed():  # closed by another thread while this call waited
            call.close()
            raise RuntimeError("this LLM is closed: LLM.close() was called")
        task = loop.create_task(call)
        try:
            return loop.run_until_complete(task)
        except BaseException:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    loop.run_until_complete(task)
            raise
