"""Several worker processes, one per tensor-parallel rank, behind the Executor interface.

The scheduler stays in the engine process. Each worker (multiprocessing spawn) joins a
torch.distributed group (gloo on CPU, NCCL on CUDA), loads its slice of the model and runs
a ModelRunner. Every step reaches the workers through one shared-memory broadcast
(executor/shm_broadcast.py), encoded once with msgspec (executor/step_codec.py):

  launch_forward   ("forward", plan)     the worker applies the plan and runs the forward
  launch_sampling  ("sample", bitmask)   rank 0 samples (with the grammar masks) and the
                                         others take its ids
  collect          ("collect",)          each worker waits for the ids and answers over its
                                         pipe: rank 0 with the StepResult, the others None

The worker runs the stages as they come, like UniProcExecutor's step thread, so under async
scheduling a rank launches the next step's forward before it waits on this step's copy.

The stages run in submission order on one thread here, so the futures contract of
Executor holds as with UniProcExecutor. A worker that dies fails the stage waiting on it
(and every later one) with an error naming it; shutdown ends every worker process.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing import get_context
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from asyncserve.config import EngineConfig
from asyncserve.core.step import StepPlan, StepResult, driver_result
from asyncserve.executor.abstract import Executor, MasksFuture
from asyncserve.executor.shm_broadcast import ShmBroadcast
from asyncserve.executor.step_codec import (
    encode_collect,
    encode_forward,
    encode_rpc,
    encode_sample,
    encode_stop,
)
from asyncserve.executor.tp_worker import worker_main

logger = logging.getLogger(__name__)

# Seconds a worker gets to exit on its own at shutdown before it is terminated.
_EXIT_GRACE_S = 5.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check_devices(tensor_parallel_size: int, device: torch.device) -> None:
    """One-line ValueError when the ranks outnumber the visible GPUs, or when the GPU ranks
    would have no NCCL to talk through."""
    if device.type != "cuda":
        return
    visible = torch.cuda.device_count()
    if tensor_parallel_size > visible:
        raise ValueError(
            f"tensor_parallel_size ({tensor_parallel_size}) exceeds the {visible} visible "
            "CUDA devices"
        )
    if not torch.distributed.is_available() or not torch.distributed.is_nccl_available():
        raise ValueError(
            f"tensor_parallel_size ({tensor_parallel_size}) on CUDA needs NCCL, which this "
            "torch build lacks"
        )


class WorkerDied(RuntimeError):
    """A worker process ended or failed; the engine cannot go on."""


class MultiProcExecutor(Executor):
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        size = config.parallel.tensor_parallel_size
        check_devices(size, device)
        ctx = get_context("spawn")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self.size = size
        self._procs: list[BaseProcess] = []
        self._conns: list[Connection] = []
        self._failure: str | None = None
        self._closing = False
        self._failure_callbacks: list[Callable[[str], None]] = []
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncserve-step")
        pipes = [ctx.Pipe() for _ in range(size)]
        self._broadcast = ShmBroadcast(ctx, [parent for parent, _ in pipes])
        # Before multiprocessing's own exit handler, which SIGTERMs daemonic children and
        # waits for them: the workers ignore SIGTERM (tp_worker.py), so it would wait forever.
        atexit.register(self.shutdown)
        try:
            for rank, (parent, child) in enumerate(pipes):
                # Daemonic, and shutdown runs at exit: the workers end with the engine
                # process even when nobody calls shutdown.
                proc = ctx.Process(
                    target=worker_main,
                    args=(
                        config,
                        device.type,
                        rank,
                        size,
                        init_method,
                        child,
                        self._broadcast.reader(rank),
                    ),
                    name=f"asyncserve-tp{rank}",
                    daemon=True,
                )
                proc.start()
                # Only the worker holds its end, so a dead worker reads as EOF here.
                child.close()
                self._procs.append(proc)
                self._conns.append(parent)
            self._replies()  # every worker reports once its model is loaded
        except BaseException:
            self.shutdown()  # ends the workers started so far, frees the shared memory
            raise
        logger.info("%d tensor-parallel workers ready (pids %s)", size, self.pids)
        threading.Thread(target=self._watch, name="asyncserve-tp-watch", daemon=True).start()

    def on_failure(self, callback: Callable[[str], None]) -> None:
        self._failure_callbacks.append(callback)

    def _watch(self) -> None:
        """Report the first worker that ends while nobody waits on it (an idle engine would
        otherwise learn of it only at its next step)."""
        ended = wait([p.sentinel for p in self._procs])
        if self._closing:
            return
        for proc in self._procs:
            if proc.sentinel in ended:
                proc.join()  # reaped, so its exit code is known
        reason = self._dead_worker()
        if reason is None:
            return
        self._failure = self._failure or reason
        for callback in self._failure_callbacks:
            callback(self._failure)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    # ---- messages ------------------------------------------------------------------------

    def _dead_worker(self, crashed_only: bool = False) -> str | None:
        """Which worker has ended, if any (`crashed_only`: with a non-zero exit code). Read
        from the sentinels: is_alive() reads a process as alive when another thread (the
        watcher) is reaping it at that moment."""
        ended = wait([p.sentinel for p in self._procs], timeout=0)
        for rank, proc in enumerate(self._procs):
            if proc.sentinel in ended:
                proc.join(1.0)
                if crashed_only and proc.exitcode == 0:
                    continue
                code = "" if proc.exitcode is None else f" (exit code {proc.exitcode})"
                return f"tensor-parallel worker {rank} (pid {proc.pid}) died{code}"
        return None

    def _fail(self, reason: str) -> WorkerDied:
        self._failure = self._failure or reason
        return WorkerDied(self._failure)

    def _check_workers(self) -> None:
        if (dead := self._dead_worker()) is not None:
            raise self._fail(dead)

    def _send(self, payload: bytes) -> None:
        """One message to every worker."""
        if self._failure is not None:
            raise WorkerDied(self._failure)
        try:
            self._broadcast.write(payload, self._check_workers)
        except OSError as e:
            # A broken pipe (an oversize message) comes before the exit is reaped.
            for proc in self._procs:
                proc.join(0.2)
            raise self._fail(self._dead_worker() or f"a worker is unreachable: {e}") from e

    def _replies(self) -> list[Any]:
        """One reply from every worker, in rank order; raises once any worker has died."""
        if self._failure is not None:
            raise WorkerDied(self._failure)
        sentinels = [p.sentinel for p in self._procs]
        out = []
        for rank, conn in enumerate(self._conns):
            # A rank blocked in a collective with a dead peer never answers: watch them all.
            while not conn.poll():
                wait([conn, *sentinels])
                if not conn.poll() and (dead := self._dead_worker()) is not None:
                    raise self._fail(dead)
            try:
                status, value = conn.recv()
            except (EOFError, OSError) as e:
                raise self._fail(self._dead_worker() or f"worker {rank} closed its pipe") from e
            if status != "ok":
                # A rank whose peer died fails its collective: name the dead one as the cause
                # (one that crashed or was killed; a rank that reported its own error, as
                # this one did, ends cleanly after it).
                wait(sentinels, timeout=1.0)
                raise self._fail(
                    self._dead_worker(crashed_only=True)
                    or f"tensor-parallel worker {rank} failed: {value}"
                )
            out.append(value)
        return out

    # ---- Executor ------------------------------------------------------------------------

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return self._thread.submit(self._rpc, method, args).result()

    def submit_rpc(self, method: str, *args: Any) -> Future[list[Any]]:
        # Behind the steps sent so far, and without blocking the caller (the event loop).
        return self._thread.submit(self._rpc, method, args)

    def _rpc(self, method: str, args: tuple[Any, ...]) -> list[Any]:
        self._send(encode_rpc(method, args))
        return self._replies()

    def launch_forward(self, plan: StepPlan, on_launched: Callable[[], None]) -> Future[Any]:
        job = self._thread.submit(self._send_forward, plan)
        # The forward is under way once every worker has the plan (or the stage failed).
        job.add_done_callback(lambda _: on_launched())
        return job

    def _send_forward(self, plan: StepPlan) -> None:
        self._send(encode_forward(plan))

    def launch_sampling(self, forwarded: Future[Any], masks: MasksFuture | None) -> Future[Any]:
        return self._thread.submit(self._sample, forwarded, masks)

    def _sample(self, forwarded: Future[Any], masks: MasksFuture | None) -> None:
        forwarded.result()  # ran before on this thread: raises if it failed
        bitmask = masks.result() if masks is not None else None
        # Only rank 0 samples (and reads the masks); one broadcast is still one write.
        self._send(encode_sample(bitmask))

    def collect(self, launched: Future[Any]) -> Future[StepResult]:
        return self._thread.submit(self._collect, launched)

    def _collect(self, launched: Future[Any]) -> StepResult:
        launched.result()
        self._send(encode_collect())
        return driver_result(self._replies(), 0)

    def shutdown(self) -> None:
        atexit.unregister(self.shutdown)
        self._closing = True
        self._thread.shutdown(wait=False, cancel_futures=True)
        # After a failure the live ranks may be blocked in a collective: no grace then.
        grace = _EXIT_GRACE_S if self._failure is None and self._dead_worker() is None else 0.0
        if grace:
            # A worker that never drains the ring is ended below.
            with contextlib.suppress(OSError, TimeoutError, WorkerDied):
                self._broadcast.write(encode_stop(), self._check_workers, timeout=1.0)
        for proc in self._procs:
            proc.join(grace)
            if proc.is_alive():
                # Blocked in a collective with a dead peer: it never reads "stop". Workers
                # ignore SIGTERM (tp_worker.py).
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._broadcast.close()
