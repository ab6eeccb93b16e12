"""Kernel compiles after start-up, each logged with its kernel and how long it took.

Start-up compiles every kernel variant a step can need (the decode graphs, the memory
profile's prefill, one step per fused-MoE tile choice). A Triton kernel that still compiles
later stalls the step that meets it, from milliseconds (a disk-cache hit) to seconds, and
shows as a latency spike (a TTFT tail, a slow first offline run). Triton calls its JIT
hooks around every compile into a process's kernel cache; once the watch is armed (start-up
done), each such compile is a warning naming the kernel, and is counted.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from asyncserve.kernels.parallel_compiles import START_UP

logger = logging.getLogger(__name__)


class CompileWatch:
    """Times Triton's in-process compiles; after arm(), logs and counts them."""

    def __init__(self) -> None:
        self.armed = False
        self.compiles_after_start = 0
        self._started: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()
        self._installed = False
        self._previous: tuple[Any, Any] = (None, None)

    def install(self) -> bool:
        """Hook into Triton (once per process; hooks set before are still called). False
        when Triton, or its JIT hooks, are not there."""
        if self._installed:
            return True
        try:
            from triton import knobs
        except ImportError:
            return False
        runtime = knobs.runtime
        if not hasattr(runtime, "jit_cache_hook") or not hasattr(runtime, "jit_post_compile_hook"):
            return False  # a Triton without these hooks: nothing is watched
        self._previous = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        runtime.jit_cache_hook = self.before_compile
        runtime.jit_post_compile_hook = self.after_compile
        self._installed = True
        return True

    def arm(self) -> None:
        """Start-up is over: compiles from now on are logged and counted."""
        self.armed = self.install()
        START_UP.finish()

    def disarm(self) -> None:
        """An engine is starting in this process: its compiles are expected."""
        self.armed = False

    def before_compile(self, *, key: Any, fn: Any, **kwargs: Any) -> bool | None:
        with self._lock:
            self._started[(fn.name, str(key))] = time.perf_counter()
        previous = self._previous[0]
        # A true result would tell Triton to skip the compile: only an earlier hook decides.
        return previous(key=key, fn=fn, **kwargs) if previous is not None else None

    def after_compile(self, *, key: Any, fn: Any, **kwargs: Any) -> bool | None:
        with self._lock:
            started = self._started.pop((fn.name, str(key)), None)
        seconds = time.perf_counter() - started if started is not None else 0.0
        if self.armed:
            self.compiles_after_start += 1
            logger.warning(
                "kernel %s compiled after start-up (%.0f ms): a step waited for it; "
                "its specialization: %s",
                fn.name,
                seconds * 1e3,
                key,
            )
        previous = self._previous[1]
        return previous(key=key, fn=fn, **kwargs) if previous is not None else None


# Triton's hooks are per process: one watch for every runner in it.
WATCH = CompileWatch()
