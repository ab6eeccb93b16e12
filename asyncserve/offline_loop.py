"""Running one offline call (LLM.generate, beam_search, embed, ...) on the LLM's event loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_call(loop: asyncio.AbstractEventLoop, call: Coroutine[Any, Any, T]) -> T:
    """Run `call` to completion. When the wait is interrupted (Ctrl-C is a KeyboardInterrupt
    raised out of the loop, not into the call), the call is cancelled and run until its
    requests are aborted: left pending, they would keep their KV blocks and run on in the
    next call."""
    task = loop.create_task(call)
    try:
        return loop.run_until_complete(task)
    except BaseException:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                loop.run_until_complete(task)
        raise
