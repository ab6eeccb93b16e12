"""The main loop of one tensor-parallel worker process (started by MultiProcExecutor).

It joins the process group, loads this rank's slice of the model, then answers the engine's
messages in order until "stop" or until the engine process goes away (its pipe reads EOF).
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections import deque
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from asyncserve.config import EngineConfig
from asyncserve.core.step import GrammarBitmask
from asyncserve.models.loader import load_model
from asyncserve.models.parallel import TensorParallel
from asyncserve.worker.model_runner import ForwardedStep, ModelRunner


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
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size)
    torch.manual_seed(config.model.seed)
    tp = TensorParallel(rank, size)
    loaded = load_model(config.model, device, tp)
    return ModelRunner(loaded, config, device, tp)


def worker_main(
    config: EngineConfig,
    device_type: str,
    rank: int,
    size: int,
    init_method: str,
    conn: Connection,
) -> None:
    try:
        runner = _start(config, device_type, rank, size, init_method)
    except Exception as exc:
        conn.send(_error(exc))
        return
    conn.send(("ok", None))
    try:
        _serve(runner, rank, conn)
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _serve(runner: ModelRunner, rank: int, conn: Connection) -> None:
    # Forwarded steps waiting for their "sample" message (two with async scheduling).
    forwarded: deque[ForwardedStep | BaseException] = deque()
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the engine process is gone
        kind = message[0]
        if kind == "stop":
            return
        if kind == "forward":
            try:
                forwarded.append(runner.launch_forward(message[1]))
            except Exception as exc:  # reported when the step is collected
                forwarded.append(exc)
        elif kind == "sample":
            conn.send(_sample(runner, rank, forwarded.popleft(), message[1]))
        elif kind == "rpc":
            try:
                conn.send(("ok", getattr(runner, message[1])(*message[2])))
            except Exception as exc:
                conn.send(_error(exc))


def _sample(
    runner: ModelRunner,
    rank: int,
    forwarded: ForwardedStep | BaseException,
    bitmask: GrammarBitmask | None,
) -> tuple[str, Any]:
    if isinstance(forwarded, BaseException):
        return _error(forwarded)
    try:
        masks: Future[GrammarBitmask | None] | None = None
        if bitmask is not None:
            masks = Future()
            masks.set_result(bitmask)
        result = runner.collect(runner.launch_sampling(forwarded, masks))
    except Exception as exc:
        return _error(exc)
    # Only rank 0's sampled ids (and logprobs) go back to the engine.
    return "ok", result if rank == 0 else None
