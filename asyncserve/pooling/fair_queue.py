"""The pooling engine's waiting jobs, taken in turn from each request: a request with a huge
input list shares every batch with the requests that came after it instead of holding them
all back until its last item is done."""

from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict, deque
from collections.abc import Iterator
from typing import Any, Generic, Protocol, TypeVar


class Job(Protocol):
    token_ids: list[int]
    future: asyncio.Future[Any]


J = TypeVar("J", bound=Job)


class FairQueue(Generic[J]):
    """Jobs grouped by request; `take` goes round the requests one job at a time."""

    def __init__(self) -> None:
        self._requests: OrderedDict[int, deque[J]] = OrderedDict()
        self._keys = itertools.count()
        self._size = 0

    def add(self, jobs: list[J]) -> int:
        """Queue one request's jobs; the key drops them with `discard`."""
        key = next(self._keys)
        if jobs:
            self._requests[key] = deque(jobs)
            self._size += len(jobs)
        return key

    def discard(self, key: int) -> None:
        """A request that is done or went away: its jobs left in the queue go."""
        jobs = self._requests.pop(key, None)
        if jobs is not None:
            self._size -= len(jobs)

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[J]:
        return itertools.chain.from_iterable(list(self._requests.values()))

    def clear(self) -> None:
        self._requests.clear()
        self._size = 0

    def take(self, max_jobs: int, max_tokens: int) -> list[J]:
        """A batch of at most max_jobs jobs and max_tokens tokens (one job at least), one job
        from each waiting request in turn; jobs whose future is done (cancelled) are dropped."""
        batch: list[J] = []
        tokens = 0
        while self._requests and len(batch) < max_jobs:
            key, jobs = next(iter(self._requests.items()))
            job = jobs[0]
            if not job.future.done():
                if batch and tokens + len(job.token_ids) > max_tokens:
                    break
                batch.append(job)
                tokens += len(job.token_ids)
            jobs.popleft()
            self._size -= 1
            if jobs:
                self._requests.move_to_end(key)  # the next request's turn
            else:
                del self._requests[key]
        return batch
