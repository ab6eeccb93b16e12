"""The server's startup heap leaves the collector's view; garbage at that moment is freed."""

from __future__ import annotations

import gc
import weakref

from asyncserve.gc_heap import MIDDLE_THRESHOLD, YOUNG_THRESHOLD, freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


def test_freeze_startup_heap_collects_then_freezes() -> None:
    thresholds = gc.get_threshold()
    garbage = _Node()
    dead = weakref.ref(garbage)
    del garbage
    alive = [_Node()]
    try:
        frozen = freeze_startup_heap()
        assert dead() is None  # collected before the freeze, not frozen with the rest
        # Other tests' threads may freeze or free objects too: only the order is certain.
        assert frozen > 0 and gc.get_freeze_count() > 0
        tracked = {id(o) for o in gc.get_objects()}
        assert id(alive) not in tracked  # out of the collector's view
        assert gc.get_threshold() == (YOUNG_THRESHOLD, MIDDLE_THRESHOLD, thresholds[2])
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)


def test_collection_paused_stops_collections_and_restores() -> None:
    from asyncserve.gc_heap import collection_paused

    assert gc.isenabled()
    with collection_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    try:
        with collection_paused():
            raise RuntimeError("an import failed")
    except RuntimeError:
        pass
    assert gc.isenabled()  # back on after an error too
    gc.disable()
    try:
        with collection_paused():
            pass
        assert not gc.isenabled()  # a caller that had it off keeps it off
    finally:
        gc.enable()
