"""Wrappers that time calls made inside the engine, for the benchmark scripts."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class Timer:
    """Wraps a callable and records how long each call took (seconds): wall time, and the
    calling thread's CPU time (which leaves out waits: for the GIL, for a device)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.starts: list[float] = []  # time.perf_counter() at each call's start

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        self.starts.append(start)
        cpu_start = time.thread_time()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.cpu_times.append(time.thread_time() - cpu_start)
            self.times.append(time.perf_counter() - start)
