"""FairQueue: batches take one job from each waiting request in turn, within the job and
token limits; cancelled jobs and discarded requests leave nothing behind."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from asyncserve.pooling.fair_queue import FairQueue


@dataclass
class Job:
    name: str
    token_ids: list[int]
    future: asyncio.Future[Any] = field(repr=False)


def test_round_robin_limits_and_cancelled_jobs() -> None:
    loop = asyncio.new_event_loop()
    try:

        def jobs(prefix: str, n: int, tokens: int = 1) -> list[Job]:
            return [Job(f"{prefix}{i}", [0] * tokens, loop.create_future()) for i in range(n)]

        queue: FairQueue[Job] = FairQueue()
        huge = queue.add(jobs("h", 1000))
        queue.add(jobs("s", 2))
        queue.add(jobs("t", 1, tokens=5))
        assert len(queue) == 1003
        # The small requests are served in the first batch, beside the huge one.
        assert [j.name for j in queue.take(5, 100)] == ["h0", "s0", "t0", "h1", "s1"]
        assert [j.name for j in queue.take(3, 100)] == ["h2", "h3", "h4"]
        # The token budget ends a batch (a first job always goes, whatever its size).
        big = queue.add(jobs("b", 2, tokens=50))
        assert [j.name for j in queue.take(10, 52)] == ["h5", "b0", "h6"]
        assert [j.name for j in queue.take(10, 10)] == ["b1"]
        queue.discard(big)  # already taken: nothing left to drop
        # Cancelled jobs are skipped and counted out.
        rest = list(queue)
        for job in rest[:10]:
            job.future.cancel()
        assert [j.name for j in queue.take(2, 100)] == ["h17", "h18"]
        queue.discard(huge)
        assert len(queue) == 0 and queue.take(4, 100) == [] and list(queue) == []
    finally:
        loop.close()
