"""Tensor-parallel workers as Ray actors, on one node or across a cluster's nodes.

`distributed_executor_backend="ray"`: the engine (scheduler, detokenizer, server) stays in
this process; each rank is a RayWorker actor in a placement group of one bundle per device
(executor/ray_cluster.py), joined by a torch.distributed group (gloo on CPU, NCCL on CUDA)
as MultiProcExecutor's processes are. Every step reaches every actor as method calls:

  launch_forward   worker.forward(plan)     each actor applies the plan and runs the forward
  launch_sampling  worker.sample(bitmask)   rank 0 samples and the others take its ids
  collect                                   the sample calls' results: rank 0's StepResult

An actor runs its calls in the order they were made, so the stages keep the Executor
futures contract. An actor (or its node) that dies fails the stage waiting on it, and every
later one, with an error naming the rank and its node; a watcher reports a death while the
engine is idle. shutdown kills the actors and frees the placement group.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from asyncserve.config import EngineConfig
from asyncserve.core.step import StepPlan, StepResult
from asyncserve.executor.abstract import Executor, MasksFuture
from asyncserve.executor.multiproc import WorkerDied
from asyncserve.executor.ray_cluster import connect, reserve
from asyncserve.executor.ray_worker import RayWorker

logger = logging.getLogger(__name__)

# How often the idle watcher asks the cluster whether every actor is alive.
_WATCH_INTERVAL_S = 1.0
# Seconds a failed rank's peers get to show up as dead (its error is then theirs).
_CAUSE_GRACE_S = 2.0


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        size = config.parallel.tensor_parallel_size
        self.size = size
        self._failure: str | None = None
        self._closing = False
        self._failure_callbacks: list[Callable[[str], None]] = []
        self._ray = ray = connect()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._group, self._owns_group = reserve(
            size, device.type, config.parallel.ray_placement_strategy
        )
        devices = {"num_gpus": 1, "num_cpus": 0} if device.type == "cuda" else {"num_cpus": 1}
        remote = ray.remote(RayWorker)
        self.workers = [
            remote.options(
                **devices,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._group, placement_group_bundle_index=rank
                ),
            ).remote()
            for rank in range(size)
        ]
        self.nodes: list[str] = []
        self.pids: list[int] = []
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncserve-step")
        try:
            address = ray.get(self.workers[0].address.remote())
            started = [
                w.start.remote(config, device.type, rank, size, address)
                for rank, w in enumerate(self.workers)
            ]
            self._replies(started, raw=True)
            placed = ray.get([w.where.remote() for w in self.workers])
        except BaseException:
            self.shutdown()
            raise
        self.nodes = [node for node, _ in placed]
        self.pids = [pid for _, pid in placed]
        logger.info(
            "%d tensor-parallel Ray workers ready on %d node(s)", size, len(set(self.nodes))
        )
        threading.Thread(target=self._watch, name="asyncserve-ray-watch", daemon=True).start()

    def on_failure(self, callback: Callable[[str], None]) -> None:
        self._failure_callbacks.append(callback)

    # ---- failures ------------------------------------------------------------------------

    def _describe(self, rank: int) -> str:
        where = ""
        if self.nodes:
            where = f" (node {self.nodes[rank][:12]}, pid {self.pids[rank]})"
        return f"tensor-parallel worker {rank}{where}"

    def _dead_worker(self) -> str | None:
        """The first rank whose actor the cluster reports dead, if any."""
        from ray._private.state import actors as actor_table

        for rank, worker in enumerate(self.workers):
            with contextlib.suppress(Exception):
                info = actor_table(worker._actor_id.hex())
                if info.get("State") == "DEAD":
                    return f"{self._describe(rank)} died: the Ray actor is dead"
        return None

    def _fail(self, reason: str) -> WorkerDied:
        self._failure = self._failure or reason
        return WorkerDied(self._failure)

    def _watch(self) -> None:
        """Report the first actor that dies while nobody waits on it (an idle engine would
        otherwise learn of it only at its next step)."""
        while not self._closing and self._failure is None:
            time.sleep(_WATCH_INTERVAL_S)
            if self._closing:
                return
            reason = self._dead_worker()
            if reason is not None and not self._closing:
                self._failure = self._failure or reason
                for callback in self._failure_callbacks:
                    callback(self._failure)
                return

    def _replies(self, refs: list[Any], raw: bool = False) -> list[Any]:
        """Every rank's result, in rank order; raises WorkerDied once any rank failed.

        Results are ("ok", value) / ("err", message) pairs unless `raw`. A rank blocked in a
        collective with a dead peer never answers, so the refs are awaited all at once."""
        ray = self._ray
        from ray.exceptions import RayActorError, RayTaskError

        out: list[Any] = [None] * len(refs)
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            if self._failure is not None:
                raise WorkerDied(self._failure)
            ready, pending = ray.wait(pending, num_returns=1, timeout=_WATCH_INTERVAL_S)
            for ref in ready:
                rank = rank_of[ref]
                try:
                    value = ray.get(ref)
                except RayActorError as exc:
                    raise self._fail(f"{self._describe(rank)} died: {_first_line(exc)}") from exc
                except RayTaskError as exc:
                    value = ("err", _first_line(exc.cause or exc))
                if raw:
                    value = ("ok", value)
                status, result = value
                if status != "ok":
                    # A rank whose peer died fails its collective: name the dead one.
                    deadline = time.monotonic() + _CAUSE_GRACE_S
                    while (dead := self._dead_worker()) is None and time.monotonic() < deadline:
                        time.sleep(0.1)
                    raise self._fail(dead or f"{self._describe(rank)} failed: {result}")
                out[rank] = result
        return out

    # ---- Executor ------------------------------------------------------------------------

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return self._thread.submit(self._rpc, method, args).result()

    def _rpc(self, method: str, args: tuple[Any, ...]) -> list[Any]:
        self._check()
        return self._replies([w.rpc.remote(method, args) for w in self.workers])

    def _check(self) -> None:
        if self._failure is not None:
            raise WorkerDied(self._failure)

    def launch_forward(self, plan: StepPlan, on_launched: Callable[[], None]) -> Future[Any]:
        job = self._thread.submit(self._forward, plan)
        # The forward is under way once every actor has the plan (or the stage failed).
        job.add_done_callback(lambda _: on_launched())
        return job

    def _forward(self, plan: StepPlan) -> None:
        self._check()
        for worker in self.workers:
            worker.forward.remote(plan)

    def launch_sampling(self, forwarded: Future[Any], masks: MasksFuture | None) -> Future[Any]:
        return self._thread.submit(self._sample, forwarded, masks)

    def _sample(self, forwarded: Future[Any], masks: MasksFuture | None) -> list[Any]:
        forwarded.result()  # ran before on this thread: raises if it failed
        self._check()
        bitmask = masks.result() if masks is not None else None
        # Only rank 0 samples, so only it needs the masks.
        return [
            w.sample.remote(bitmask if rank == 0 else None) for rank, w in enumerate(self.workers)
        ]

    def collect(self, launched: Future[Any]) -> Future[StepResult]:
        return self._thread.submit(self._collect, launched)

    def _collect(self, launched: Future[Any]) -> StepResult:
        result = self._replies(launched.result())[0]
        assert isinstance(result, StepResult)
        return result

    def shutdown(self) -> None:
        self._closing = True
        self._thread.shutdown(wait=False, cancel_futures=True)
        ray = self._ray
        if self._failure is None:
            # A clean exit leaves the process group; after a failure a rank may be blocked
            # in a collective and would never answer.
            with contextlib.suppress(Exception):
                ray.get([w.stop.remote() for w in self.workers], timeout=5.0)
        for worker in self.workers:
            with contextlib.suppress(Exception):
                ray.kill(worker)
        if self._owns_group:
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(self._group)
        self._owns_group = False
        self.workers = []


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
