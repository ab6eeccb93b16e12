"""Tensor-parallel workers as Ray actors, on one node or across a cluster's nodes.

`distributed_executor_backend="ray"`: the engine (scheduler, detokenizer, server) stays in
this process; each rank is a RayWorker actor in a placement group of one bundle per device
(executor/ray_cluster.py), joined by a torch.distributed group (gloo on CPU, NCCL on CUDA)
as MultiProcExecutor's processes are.

Ray places the actors and reports their deaths; the steps go over one authenticated
connection per actor (opened by the actor back to this process), as the same messages a
MultiProcExecutor worker reads from its pipe:

  launch_forward   ("forward", plan)     every rank applies the plan and runs the forward
  launch_sampling  ("sample", bitmask)   rank 0 samples and the others take its ids
  collect                                one reply per rank: rank 0's is the StepResult

The stages run in submission order on one thread here. Under pipeline parallelism
(executor/ray_pipeline.py has the whole picture) the engine keeps one step per pipeline
stage in flight: "collect" follows each "sample" at once and the replies are read on a
second thread, so the step thread goes on sending the next micro-batch to the first stage
while the last one computes. An actor (or its node) that dies
fails the stage waiting on it, and every later one, with an error naming the rank and its
node; a watcher reports a death while the engine is idle. shutdown stops the actors, kills
what is left and frees the placement group.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener, wait
from typing import Any

import torch

from asyncserve.config import EngineConfig
from asyncserve.core.step import StepPlan, StepResult, driver_result
from asyncserve.executor.abstract import Executor, MasksFuture
from asyncserve.executor.multiproc import WorkerDied
from asyncserve.executor.ray_cluster import connect, reserve
from asyncserve.executor.ray_pipeline import driver_reply
from asyncserve.executor.ray_worker import RayWorker, no_delay, send_by_value

logger = logging.getLogger(__name__)

# How often a wait for replies looks at the watcher's verdict (a node that vanishes
# without closing its connections is known only to Ray).
_POLL_S = 1.0
# Seconds a failed rank's peers get to show up as dead (its error is then theirs), and the
# actors get to stop on their own at shutdown.
_GRACE_S = 2.0
_EXIT_GRACE_S = 5.0
# Seconds the actors get to connect back and load the model.
_START_TIMEOUT_S = 600.0


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        size = config.parallel.world_size
        self.size = size
        # The rank that samples: the first of the last pipeline stage.
        self.driver = (config.parallel.pipeline_parallel_size - 1) * (
            config.parallel.tensor_parallel_size
        )
        self.max_concurrent_batches = config.parallel.pipeline_parallel_size
        # Reads the replies under pipeline parallelism (None: the step thread reads them).
        self._reader: ThreadPoolExecutor | None = None
        if self.max_concurrent_batches > 1:
            self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncserve-pp")
        self._failure: str | None = None
        self._closing = False
        self._failure_callbacks: list[Callable[[str], None]] = []
        self._conns: list[Connection] = []
        self._runs: list[Any] = []
        self.nodes: list[str] = []
        self.pids: list[int] = []
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
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncserve-step")
        authkey = secrets.token_bytes(32)
        self._listener = Listener((ray.util.get_node_ip_address(), 0), authkey=authkey)
        try:
            placed = ray.get([w.where.remote() for w in self.workers])
            self.nodes = [node for node, _ in placed]
            self.pids = [pid for _, pid in placed]
            init_method = ray.get(self.workers[0].address.remote())
            self._runs = [
                w.run.remote(
                    config, device.type, rank, size, init_method, self._listener.address, authkey
                )
                for rank, w in enumerate(self.workers)
            ]
            self._accept()
            self._replies()  # every rank reports once its model is loaded
        except BaseException:
            self.shutdown()
            raise
        logger.info("%d Ray workers ready on %d node(s)", size, len(set(self.nodes)))
        threading.Thread(target=self._watch, name="asyncserve-ray-watch", daemon=True).start()

    def _accept(self) -> None:
        """One connection per actor, put in rank order; an actor that fails before it
        connects ends the wait with its error."""
        ray = self._ray
        conns: dict[int, Connection] = {}
        accepted: list[Connection] = []

        def accept() -> None:
            while len(accepted) < self.size:
                try:
                    accepted.append(self._listener.accept())
                except AuthenticationError:
                    continue  # not one of ours (no key): keep listening
                except OSError:
                    return  # closed: the start failed

        acceptor = threading.Thread(target=accept, name="asyncserve-ray-accept", daemon=True)
        acceptor.start()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while acceptor.is_alive():
            done, _ = ray.wait(self._runs, num_returns=1, timeout=0.2)
            if done:
                self._check_run(done[0])
            if time.monotonic() > deadline:
                raise WorkerDied(f"the Ray workers did not connect within {_START_TIMEOUT_S} s")
            acceptor.join(0.05)
        if len(accepted) < self.size:
            raise WorkerDied("the engine stopped listening before every Ray worker connected")
        for conn in accepted:
            no_delay(conn)
            conns[int(conn.recv())] = conn
        self._conns = [conns[rank] for rank in range(self.size)]

    def _check_run(self, ref: Any) -> None:
        """Raise WorkerDied for a finished run call: the actor died, or stopped early."""
        ray = self._ray
        rank = self._runs.index(ref)
        try:
            ray.get(ref)
        except Exception as exc:
            raise self._fail(f"{self._describe(rank)} died: {_first_line(exc)}") from exc
        raise self._fail(f"{self._describe(rank)} stopped")

    def on_failure(self, callback: Callable[[str], None]) -> None:
        self._failure_callbacks.append(callback)

    # ---- failures ------------------------------------------------------------------------

    def _describe(self, rank: int) -> str:
        where = ""
        if self.nodes:
            where = f" (node {self.nodes[rank][:12]}, pid {self.pids[rank]})"
        return f"tensor-parallel worker {rank}{where}"

    def _dead_worker(self, timeout: float = 0.0) -> str | None:
        """The first rank whose actor has ended, if any (within `timeout` seconds)."""
        ray = self._ray
        done, _ = ray.wait(self._runs, num_returns=1, timeout=timeout)
        if not done:
            return None
        try:
            self._check_run(done[0])
        except WorkerDied as exc:
            return str(exc)
        return None

    def _fail(self, reason: str) -> WorkerDied:
        self._failure = self._failure or reason
        return WorkerDied(self._failure)

    def _watch(self) -> None:
        """Report the first actor that ends while nobody waits on it (an idle engine would
        otherwise learn of it only at its next step)."""
        ray = self._ray
        with contextlib.suppress(Exception):
            ray.wait(self._runs, num_returns=1)
        if self._closing:
            return
        reason = self._dead_worker()
        if reason is None:
            return
        self._failure = self._failure or reason
        for callback in self._failure_callbacks:
            callback(self._failure)

    # ---- messages ------------------------------------------------------------------------

    def _send(self, messages: list[tuple[Any, ...]]) -> None:
        if self._failure is not None:
            raise WorkerDied(self._failure)
        for rank, (conn, message) in enumerate(zip(self._conns, messages, strict=True)):
            try:
                send_by_value(conn, message)
            except OSError as e:
                reason = (
                    self._dead_worker(_GRACE_S) or f"{self._describe(rank)} is unreachable: {e}"
                )
                raise self._fail(reason) from e

    def _replies(self) -> list[Any]:
        """One reply from every rank, in rank order; raises once any rank has failed. A rank
        blocked in a collective with a dead peer never answers: all are watched at once."""
        out: list[Any] = [None] * self.size
        pending = dict(enumerate(self._conns))
        while pending:
            if self._failure is not None:
                raise WorkerDied(self._failure)
            rank_of = {id(conn): rank for rank, conn in pending.items()}
            for ready in wait(list(pending.values()), timeout=_POLL_S):
                rank = rank_of[id(ready)]
                conn = self._conns[rank]
                try:
                    status, value = conn.recv()
                except (EOFError, OSError) as e:
                    reason = (
                        self._dead_worker(_GRACE_S)
                        or f"{self._describe(rank)} closed its connection"
                    )
                    raise self._fail(reason) from e
                if status != "ok":
                    # A rank whose peer died fails its collective: name the dead one.
                    dead = self._dead_worker(_GRACE_S)
                    raise self._fail(dead or f"{self._describe(rank)} failed: {value}")
                out[rank] = value
                del pending[rank]
        return out

    # ---- Executor ------------------------------------------------------------------------

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return self._thread.submit(self._rpc, method, args).result()

    def submit_rpc(self, method: str, *args: Any) -> Future[list[Any]]:
        # Behind the steps sent so far, and without blocking the caller (the event loop).
        return self._thread.submit(self._rpc, method, args)

    def _rpc(self, method: str, args: tuple[Any, ...]) -> list[Any]:
        self._send([("rpc", method, args)] * self.size)
        if self._reader is not None:  # after the replies of the steps sent before
            return self._reader.submit(self._replies).result()
        return self._replies()

    def launch_forward(self, plan: StepPlan, on_launched: Callable[[], None]) -> Future[Any]:
        job = self._thread.submit(self._send, [("forward", plan)] * self.size)
        # The forward is under way once every rank has the plan (or the stage failed).
        job.add_done_callback(lambda _: on_launched())
        return job

    def launch_sampling(self, forwarded: Future[Any], masks: MasksFuture | None) -> Future[Any]:
        if self._reader is not None:
            return self._thread.submit(self._sample_and_collect, forwarded, masks)
        return self._thread.submit(self._sample, forwarded, masks)

    def _sample_and_collect(
        self, forwarded: Future[Any], masks: MasksFuture | None
    ) -> Future[list[Any]]:
        """Pipeline parallelism: sample and ask for the step's replies at once; they are
        read on the reader thread (in the order asked), while this thread sends on."""
        assert self._reader is not None
        self._sample(forwarded, masks)
        self._send([("collect",)] * self.size)
        return self._reader.submit(self._replies)

    def _sample(self, forwarded: Future[Any], masks: MasksFuture | None) -> None:
        forwarded.result()  # ran before on this thread: raises if it failed
        bitmask = masks.result() if masks is not None else None
        # Only the driver samples, so only it needs the masks.
        self._send([("sample", bitmask if r == self.driver else None) for r in range(self.size)])

    def collect(self, launched: Future[Any]) -> Future[StepResult]:
        if self._reader is not None:
            return driver_reply(launched, self.driver)
        return self._thread.submit(self._collect, launched)

    def _collect(self, launched: Future[Any]) -> StepResult:
        launched.result()
        self._send([("collect",)] * self.size)
        return driver_result(self._replies(), self.driver)

    def shutdown(self) -> None:
        self._closing = True
        self._thread.shutdown(wait=False, cancel_futures=True)
        if self._reader is not None:
            self._reader.shutdown(wait=False, cancel_futures=True)
        ray = self._ray
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(("stop",))
        if self._runs and self._failure is None:
            # A clean stop leaves the process group; after a failure a rank may be blocked
            # in a collective and would never read "stop".
            ray.wait(self._runs, num_returns=len(self._runs), timeout=_EXIT_GRACE_S)
        for worker in self.workers:
            with contextlib.suppress(Exception):
                ray.kill(worker)
        for conn in self._conns:
            with contextlib.suppress(OSError):  # a dead rank's may be closed already
                conn.close()
        self._listener.close()
        if self._owns_group:
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(self._group)
        self._owns_group = False
        self.workers = []


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
