"""One writer, N readers: a ring of message slots in shared memory (the step plans going
from the engine process to every tensor-parallel worker).

The writer encodes a message once and copies it into the next slot; every reader copies it
out. Two POSIX semaphores per reader order it all (and are the memory barriers):

  ready[r]   messages written and not yet read by reader r (the reader's wake-up)
  free[r]    slots reader r has given back (the writer waits on it when the ring is full)

An uncontended semaphore costs no system call, and a blocked reader wakes on a futex, as
it would on a pipe, without the pipe's copy of every message per reader. A message larger
than a slot goes over the reader's pipe instead, and its slot says so.
"""

from __future__ import annotations

import multiprocessing.resource_tracker as resource_tracker
import os
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from multiprocessing.shared_memory import SharedMemory
from multiprocessing.synchronize import Semaphore
from typing import Any

# Slot header: payload length, or _OVERFLOW when the payload went over the pipe.
_HEADER = struct.Struct("<Q")
_OVERFLOW = (1 << 64) - 1
# How often a waiting side checks that its peers are still there.
_POLL_S = 0.5


@dataclass
class ReaderHandle:
    """What a reader process needs to attach (picklable: passed to the spawned worker)."""

    shm_name: str
    num_slots: int
    slot_bytes: int
    ready: Semaphore
    free: Semaphore


class ShmBroadcast:
    """The writer side; `overflow[r]` is reader r's pipe, used for oversize messages."""

    def __init__(
        self,
        ctx: BaseContext,
        overflow: Sequence[Connection],
        num_slots: int = 8,
        slot_bytes: int = 1 << 20,
    ) -> None:
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self._overflow = list(overflow)
        self._shm = SharedMemory(create=True, size=num_slots * slot_bytes)
        self._buf = _buffer(self._shm)
        self._ready = [ctx.Semaphore(0) for _ in overflow]
        self._free = [ctx.Semaphore(num_slots) for _ in overflow]
        self._next = 0
        self._closed = False
        # The step thread writes; shutdown may write "stop" from another thread meanwhile.
        self._lock = threading.Lock()

    def reader(self, rank: int) -> ReaderHandle:
        return ReaderHandle(
            self._shm.name, self.num_slots, self.slot_bytes, self._ready[rank], self._free[rank]
        )

    def write(
        self, payload: bytes, check: Callable[[], None], timeout: float | None = None
    ) -> None:
        """Publish `payload` to every reader. While the ring is full, `check()` runs every
        half second (it raises when a reader has died); TimeoutError after `timeout` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            raise TimeoutError("another write is stuck on the ring")
        try:
            self._wait_for_slot(check, deadline)
            self._write(payload)
        finally:
            self._lock.release()

    def _wait_for_slot(self, check: Callable[[], None], deadline: float | None) -> None:
        taken: list[Any] = []
        try:
            for free in self._free:
                while not free.acquire(timeout=_POLL_S if deadline is None else 0.0):
                    check()
                    if deadline is not None:
                        if time.monotonic() > deadline:
                            raise TimeoutError("the readers have not drained the ring")
                        time.sleep(0.01)
                taken.append(free)
        except BaseException:
            for free in taken:  # the slot stays free for the readers that had one
                free.release()
            raise

    def _write(self, payload: bytes) -> None:
        start = (self._next % self.num_slots) * self.slot_bytes
        self._next += 1
        size = len(payload)
        if _HEADER.size + size <= self.slot_bytes:
            _HEADER.pack_into(self._buf, start, size)
            self._buf[start + _HEADER.size : start + _HEADER.size + size] = payload
            for ready in self._ready:
                ready.release()
            return
        _HEADER.pack_into(self._buf, start, _OVERFLOW)
        for ready, conn in zip(self._ready, self._overflow, strict=True):
            # Woken first: a payload larger than the pipe's buffer needs its reader reading.
            ready.release()
            conn.send_bytes(payload)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        del self._buf
        self._shm.close()
        self._shm.unlink()


class ShmReader:
    """One reader's side, in its own process."""

    def __init__(self, handle: ReaderHandle, overflow: Connection, spin_s: float = 0.0) -> None:
        self._handle = handle
        self._overflow = overflow
        self._spin_s = spin_s
        self._shm = _attach(handle.shm_name)
        self._buf = _buffer(self._shm)
        self._next = 0
        self._parent = os.getppid()

    def read(self) -> bytes | None:
        """The next message; None once the writer's process is gone."""
        ready = self._handle.ready
        if not self._spin(ready):
            while not ready.acquire(timeout=_POLL_S):
                if os.getppid() != self._parent:
                    return None  # orphaned: the engine process died
        start = (self._next % self._handle.num_slots) * self._handle.slot_bytes
        self._next += 1
        (size,) = _HEADER.unpack_from(self._buf, start)
        if size == _OVERFLOW:
            try:
                payload = self._overflow.recv_bytes()
            except (EOFError, OSError):
                return None
        else:
            payload = bytes(self._buf[start + _HEADER.size : start + _HEADER.size + size])
        self._handle.free.release()
        return payload

    def _spin(self, ready: Any) -> bool:
        """Poll for a while before sleeping on the semaphore (a GPU worker between two steps
        has a core to itself; on a shared CPU host spinning only takes cores away)."""
        if self._spin_s <= 0.0:
            return False
        deadline = time.perf_counter() + self._spin_s
        while time.perf_counter() < deadline:
            if ready.acquire(False):
                return True
        return False

    def close(self) -> None:
        del self._buf
        self._shm.close()


def _buffer(shm: SharedMemory) -> memoryview:
    buf = shm.buf
    assert buf is not None  # None only after close()
    return buf


def _attach(name: str) -> SharedMemory:
    # The writer owns the segment (it unlinks it). Without this the reader's process would
    # register it too and the resource tracker could unlink it, or warn, when a reader ends.
    register = resource_tracker.register
    resource_tracker.register = lambda *args, **kwargs: None  # type: ignore[assignment]
    try:
        return SharedMemory(name=name)
    finally:
        resource_tracker.register = register  # type: ignore[assignment]
