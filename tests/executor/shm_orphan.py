"""Processes for test_shm_broadcast's orphan test, in a module that imports no torch (the
spawned processes start in a fraction of a second)."""

from __future__ import annotations

import os
from multiprocessing import get_context
from multiprocessing.connection import Connection
from typing import Any

from asyncserve.executor.shm_broadcast import ReaderHandle, ShmReader


def _reader_until_orphaned(handle: ReaderHandle, conn: Connection, pids: Any) -> None:
    pids.put(os.getpid())
    reader = ShmReader(handle, conn)
    while reader.read() is not None:
        pass  # None: its parent (the engine process, here) died


def middle_process(handle: ReaderHandle, conn: Connection, pids: Any) -> None:
    proc = get_context("spawn").Process(target=_reader_until_orphaned, args=(handle, conn, pids))
    proc.start()
    proc.join()
