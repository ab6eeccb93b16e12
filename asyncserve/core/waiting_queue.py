"""The scheduler's queue of waiting requests: first come first served, or by priority."""

from __future__ import annotations

import heapq
import itertools
from collections import deque

from asyncserve.core.request import Request


class WaitingQueue:
    """Waiting requests in admission order: fcfs (deque) or (priority, arrival) (heap).

    Requests finished while waiting are dropped lazily when they reach the head, so an
    abort is O(1); `len` counts only live requests.
    """

    def __init__(self, priority: bool) -> None:
        self._priority = priority
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()
        self._live = 0

    def __len__(self) -> int:
        return self._live

    def push(self, request: Request) -> None:
        self._live += 1
        if self._priority:
            entry = (request.priority, request.arrival_time, next(self._seq), request)
            heapq.heappush(self._heap, entry)
        else:
            self._fifo.append(request)

    def push_front(self, request: Request) -> None:
        """A preempted request: first in line under fcfs, by its key under priority."""
        if self._priority:
            self.push(request)
        else:
            self._live += 1
            self._fifo.appendleft(request)

    def peek(self) -> Request | None:
        if self._priority:
            heap = self._heap
            while heap and heap[0][3].is_finished:
                heapq.heappop(heap)
            return heap[0][3] if heap else None
        fifo = self._fifo
        while fifo and fifo[0].is_finished:
            fifo.popleft()
        return fifo[0] if fifo else None

    def pop(self) -> Request:
        """Remove the head; call right after peek() returned it."""
        self._live -= 1
        if self._priority:
            return heapq.heappop(self._heap)[3]
        return self._fifo.popleft()

    def discard(self, request: Request) -> None:
        """Account for a request finished while waiting; the caller sets its status."""
        self._live -= 1
