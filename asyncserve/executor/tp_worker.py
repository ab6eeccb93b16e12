"""The main loop of one tensor-parallel worker process (started by MultiProcExecutor).

It joins the process group, loads this rank's slice of the model, then answers the engine's
messages in order until "stop" or until the engine process goes away. The loop (`serve`)
reads and answers through a WorkerTransport, so another executor can drive it over its own
channel; MultiProcExecutor's is ShmTransport: messages from the shared-memory broadcast,
replies over the worker's pipe.
"""

from __future__ import annotations

import contextlib
import os
import signal
import traceback
from collections import deque
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any, Protocol

import torch
import torch.distributed as dist

from asyncserve.config import EngineConfig
from asyncserve.core.step import GrammarBitmask
from asyncserve.executor.shm_broadcast import ReaderHandle, ShmReader
from asyncserve.executor.step_codec import Message, decode
from asyncserve.kernels.parallel_compiles import warm_up_compiler
from asyncserve.models.loader import load_model
from asyncserve.models.parallel import TensorParallel
from asyncserve.worker import fast_all_reduce
from asyncserve.worker.model_runner import ForwardedStep, LaunchedStep, ModelRunner


def _error(exc: BaseException) -> tuple[str, str]:
    # The last frame is enough to find it; the full trace goes to the worker's stderr.
    traceback.print_exception(exc)
    return "err", f"{type(exc).__name__}: {exc}"


def _start(
    config: EngineConfig, device_type: str, rank: int, size: int, init_method: str
) -> ModelRunner:
    if device_type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        # The ranks share the host's cores: one share each instead of all of them each.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
        backend = "gloo"
    warm_up_compiler(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size)
    torch.manual_seed(config.model.seed)
    tp = TensorParallel(rank, size, config.parallel.enable_expert_parallel)
    loaded = load_model(config.model, device, tp)
    if not config.parallel.disable_custom_all_reduce:
        tp.fast.reduce = fast_all_reduce.build(rank, size, device, loaded.dtype)
    return ModelRunner(loaded, config, device, tp)


class WorkerTransport(Protocol):
    """How a worker gets the engine's messages and answers them."""

    def recv(self) -> Message | None:
        """The next message: ("forward", StepPlan), ("sample", GrammarBitmask | None),
        ("rpc", method, args) or ("stop",); None once the engine is gone."""

    def send(self, reply: tuple[str, Any]) -> None:
        """("ok", value) or ("err", one line); one per "sample" and "rpc" message."""


class ShmTransport:
    """Messages from the engine's shared-memory broadcast, replies over the pipe."""

    def __init__(self, handle: ReaderHandle, conn: Connection, spin_s: float) -> None:
        self._reader = ShmReader(handle, conn, spin_s)
        self._conn = conn

    def recv(self) -> Message | None:
        data = self._reader.read()
        return None if data is None else decode(data)

    def send(self, reply: tuple[str, Any]) -> None:
        self._conn.send(reply)

    def close(self) -> None:
        self._reader.close()


def worker_main(
    config: EngineConfig,
    device_type: str,
    rank: int,
    size: int,
    init_method: str,
    conn: Connection,
    handle: ReaderHandle,
) -> None:
    # Ctrl-C and a service manager's SIGTERM reach the whole process group: the engine
    # process drains and then ends the workers ("stop", or SIGKILL past the grace); a worker
    # that died of the signal first would fail the requests still running. An engine
    # process that dies without that is noticed by the reader (ShmReader.read: orphaned).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        runner = _start(config, device_type, rank, size, init_method)
    except Exception as exc:
        conn.send(_error(exc))
        return
    # A GPU worker polls a little for the next message; CPU ranks share the host's cores.
    transport = ShmTransport(handle, conn, spin_s=0.001 if device_type == "cuda" else 0.0)
    conn.send(("ok", None))
    try:
        serve(runner, rank, transport)
    finally:
        transport.close()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def serve(runner: ModelRunner, rank: int, transport: WorkerTransport) -> None:
    """Answer the engine's messages in order until "stop" or until it is gone.

    A step is three messages, the three stages of Executor: "forward" and "sample" only
    enqueue work, "collect" waits for the sampled ids and answers. With async scheduling the
    next step's "forward" comes before this step's "collect", so the device runs it while
    this rank waits for the copy."""
    # Steps waiting for their "sample", then for their "collect" message (errors included:
    # reported when the step is collected).
    forwarded: deque[ForwardedStep | BaseException] = deque()
    launched: deque[LaunchedStep | BaseException] = deque()
    while True:
        try:
            message = transport.recv()
        except (EOFError, OSError):
            return  # the engine process is gone
        if message is None:
            return
        kind = message[0]
        if kind == "stop":
            return
        if kind == "forward":
            try:
                forwarded.append(runner.launch_forward(message[1]))
            except Exception as exc:
                forwarded.append(exc)
        elif kind == "sample":
            launched.append(_launch_sampling(runner, forwarded.popleft(), message[1]))
        elif kind == "collect":
            transport.send(_collect(runner, rank, launched.popleft()))
        elif kind == "rpc":
            try:
                transport.send(("ok", getattr(runner, message[1])(*message[2])))
            except Exception as exc:
                transport.send(_error(exc))


def _launch_sampling(
    runner: ModelRunner, forwarded: ForwardedStep | BaseException, bitmask: GrammarBitmask | None
) -> LaunchedStep | BaseException:
    if isinstance(forwarded, BaseException):
        return forwarded
    try:
        masks: Future[GrammarBitmask | None] | None = None
        if bitmask is not None:
            masks = Future()
            masks.set_result(bitmask)
        return runner.launch_sampling(forwarded, masks)
    except Exception as exc:
        return exc


def _collect(
    runner: ModelRunner, rank: int, launched: LaunchedStep | BaseException
) -> tuple[str, Any]:
    if isinstance(launched, BaseException):
        return _error(launched)
    try:
        result = runner.collect(launched)
    except Exception as exc:
        return _error(exc)
    # Only rank 0's sampled ids (and logprobs) go back to the engine; the others report
    # the requests they failed (core/step.py driver_result).
    return "ok", result if rank == 0 else (result.failed_requests or None)
