"""Keep garbage collection pauses short while serving.

Everything alive once the server is set up (the model, the tokenizer, imported modules:
about 190,000 tracked objects in the bare HTTP server) stays alive until exit, yet each full
collection walks all of it. With a few hundred streams, objects that outlive a step reach
the oldest generation quickly and set off a full collection about once a second: 70-75 ms
with the event loop stopped (W7 stub server, 500 streams), every stream's p99 gap between
tokens. vLLM's API server freezes its startup heap the same way.

The young generation's threshold goes up as well: at tens of thousands of streamed tokens a
second, CPython's default (a collection every 700 container allocations) runs hundreds of
young collections a second, and each promotes whatever is in flight at that moment (a
pending output, a coroutine frame) toward the oldest generation.

At start-up the imports (torch, the server, the engine) allocate most of those objects in a
few seconds, and CPython's collector walks the growing heap again and again while they run:
about an eighth of the import time. `collection_paused` keeps it off for those imports.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

# Container allocations between young collections (CPython: 700), and young collections
# per middle one (CPython: 10); the oldest generation's trigger stays CPython's.
YOUNG_THRESHOLD = 50_000
MIDDLE_THRESHOLD = 20


@contextmanager
def collection_paused() -> Iterator[None]:
    """No garbage collection while the block runs (start-up imports: nearly every object they
    make lives until exit). Collection is on again after it, as it was before it."""
    if not gc.isenabled():  # the caller's choice: left as it is
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def freeze_startup_heap() -> int:
    """Collect what is garbage now, move every surviving object out of the collector's view
    (reference counting still frees them) and space young collections out. Returns how many
    objects were frozen."""
    gc.collect()
    gc.freeze()
    _, _, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, MIDDLE_THRESHOLD, oldest)
    return gc.get_freeze_count()


def thaw_startup_heap(thresholds: tuple[int, int, int]) -> None:
    """Undo freeze_startup_heap before an engine shuts down: the frozen objects go back to the
    oldest generation (so the closed engine's reference cycles, device tensors among them,
    can be collected) and the collection thresholds are set back to `thresholds`."""
    gc.unfreeze()
    gc.set_threshold(*thresholds)
