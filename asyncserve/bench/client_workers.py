"""Running the benchmark's requests in one or several client processes.

The whole arrival schedule is drawn up front (Poisson at `--request-rate`, or all at time 0)
and dealt round-robin to the processes, so their union is exactly that schedule. Each process
(multiprocessing spawn, its own event loop) sends its requests at their times from a start
instant shared as wall-clock time, and returns its records and how much CPU it used.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import multiprocessing
import random
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from asyncserve.bench.sse_client import (
    Endpoint,
    ReadStats,
    RequestRecord,
    build_request,
    stream_request,
)

# Time given to every process between "go" and the first request, so that none starts late.
START_DELAY_S = 0.05


@dataclass
class Job:
    index: int
    send_at: float  # seconds after the benchmark's start
    prompt: list[int]
    output_len: int


@dataclass
class WorkerPlan:
    base_url: str
    path: str
    model: str
    headers: dict[str, str]
    ignore_eos: bool
    max_concurrency: int | None
    jobs: list[Job] = field(default_factory=list)


@dataclass
class WorkerResult:
    records: list[tuple[int, RequestRecord]]
    stats: ReadStats
    cpu_s: float  # process CPU time (user + system) during the run
    wall_s: float  # from the shared start to this process's last response


def arrival_times(num: int, rate: float, seed: int) -> list[float]:
    """Send times from 0: exponential gaps at `rate` req/s (Poisson), or all 0 for inf."""
    if rate == float("inf"):
        return [0.0] * num
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(num):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def split_jobs(jobs: list[Job], parts: int) -> list[list[Job]]:
    """Round-robin: each part is a thinned copy of the schedule, not a slice of time."""
    return [jobs[k::parts] for k in range(parts)]


def split_concurrency(limit: int | None, parts: int) -> list[int | None]:
    """A --max-concurrency limit shared out so the processes' limits add up to it."""
    if limit is None:
        return [None] * parts
    return [limit // parts + (1 if k < limit % parts else 0) for k in range(parts)]


def payload(plan: WorkerPlan, job: Job) -> dict[str, Any]:
    return {
        "model": plan.model,
        "prompt": job.prompt,
        "max_tokens": job.output_len,
        "ignore_eos": plan.ignore_eos,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _raise_open_files_limit(needed: int) -> None:
    # One socket per in-flight request; the default soft limit (often 1024) is too low for
    # a few thousand streams, the hard limit usually is not.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def _drive(plan: WorkerPlan, start_wall: float) -> WorkerResult:
    endpoint = Endpoint.parse(plan.base_url, plan.path)
    requests = [build_request(endpoint, payload(plan, job), plan.headers) for job in plan.jobs]
    _raise_open_files_limit(len(requests) + 64)
    stats = ReadStats()
    limit = asyncio.Semaphore(plan.max_concurrency) if plan.max_concurrency else None
    # perf_counter has no shared origin across processes; the wall clock does.
    t_start = time.perf_counter() + (start_wall - time.time())

    async def one(job: Job, request: bytes) -> tuple[int, RequestRecord]:
        record = RequestRecord(prompt_len=len(job.prompt))
        if limit is None:
            return job.index, await stream_request(endpoint, request, record, stats, t_start)
        async with limit:
            return job.index, await stream_request(endpoint, request, record, stats, t_start)

    # The prompts are hundreds of thousands of objects that live all run: keep the collector
    # from walking them again and again (its pauses would show up as latency).
    gc.collect()
    gc.freeze()
    await asyncio.sleep(max(0.0, t_start - time.perf_counter()))
    cpu0 = time.process_time()
    tasks = []
    for job, request in zip(plan.jobs, requests, strict=True):
        delay = t_start + job.send_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(job, request)))
    records = await asyncio.gather(*tasks)
    wall = time.perf_counter() - t_start
    gc.unfreeze()
    return WorkerResult(list(records), stats, time.process_time() - cpu0, wall)


def run_plan(plan: WorkerPlan, start_wall: float) -> WorkerResult:
    """One process's share, on uvloop where it is installed."""
    factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop
    with contextlib.suppress(ImportError):
        import uvloop

        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(_drive(plan, start_wall))


def _child(conn: Connection, plan: WorkerPlan) -> None:
    conn.send("ready")
    start_wall = conn.recv()
    conn.send(run_plan(plan, start_wall))
    conn.close()


def run_plans(plans: list[WorkerPlan]) -> list[WorkerResult]:
    """Run each plan in its own process; one plan runs in this process."""
    if len(plans) == 1:
        return [run_plan(plans[0], time.time() + START_DELAY_S)]
    ctx = multiprocessing.get_context("spawn")
    procs, conns = [], []
    for plan in plans:
        parent_end, child_end = ctx.Pipe()
        proc = ctx.Process(target=_child, args=(child_end, plan), daemon=True)
        proc.start()
        child_end.close()
        procs.append(proc)
        conns.append(parent_end)
    try:
        for conn in conns:  # every process has started and imported before the clock runs
            if conn.recv() != "ready":
                raise RuntimeError("a client process failed to start")
        start_wall = time.time() + START_DELAY_S
        for conn in conns:
            conn.send(start_wall)
        return [conn.recv() for conn in conns]
    except EOFError as exc:
        raise RuntimeError("a client process exited early; see its traceback above") from exc
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
