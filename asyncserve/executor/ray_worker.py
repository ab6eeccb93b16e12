"""One tensor-parallel rank as a Ray actor (started by RayExecutor).

Ray places the actor and watches its life; the steps do not go through Ray's task calls
(a few hundred microseconds each, several per step) but over one authenticated connection
back to the engine process, answered by the same message loop a MultiProcExecutor worker
runs over its pipe (executor/tp_worker.py). The actor's calls:

  address()  rank 0: where the process group meets (this node's IP, a free port)
  where()    (Ray node id, pid) of this rank
  run(...)   connect to the engine, join the group, load this rank's slice of the model,
             then answer the engine's messages until "stop" or until the engine goes away;
             the call returns only then, so a Ray error on it means the actor died

Ray gives each actor its own device (CUDA_VISIBLE_DEVICES holds one GPU), so every rank
runs on cuda:0 of its own view.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
from multiprocessing.connection import Client, Connection
from typing import Any

import torch
import torch.distributed as dist

from asyncserve.config import EngineConfig
from asyncserve.executor.step_codec import Message
from asyncserve.executor.tp_worker import _error, serve
from asyncserve.kernels.parallel_compiles import warm_up_compiler
from asyncserve.models.loader import load_model
from asyncserve.models.parallel import TensorParallel
from asyncserve.models.pipeline import PipelineStage
from asyncserve.worker.model_runner import ModelRunner


class RayWorker:
    def address(self) -> str:
        """A tcp:// address on this node for the process group's rendezvous."""
        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        return f"tcp://{host}:{port}"

    def where(self) -> tuple[str, int]:
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()

    def run(
        self,
        config: EngineConfig,
        device_type: str,
        rank: int,
        size: int,
        init_method: str,
        engine_address: tuple[str, int],
        authkey: bytes,
    ) -> None:
        conn = Client(engine_address, authkey=authkey)
        no_delay(conn)
        try:
            conn.send(rank)  # the engine accepts the ranks in any order
            try:
                runner = _start(config, device_type, rank, size, init_method)
            except Exception as exc:
                conn.send(_error(exc))
                return
            conn.send(("ok", None))
            # The loop returns the StepResult from its "rank 0": the sampling rank, the
            # first of the last pipeline stage.
            driver = (config.parallel.pipeline_parallel_size - 1) * tp_size(config)
            serve(runner, 0 if rank == driver else rank + 1, ConnTransport(conn))
        finally:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
            conn.close()


class ConnTransport:
    """The engine's messages and this rank's replies as pickled tuples over the connection
    (tp_worker.WorkerTransport)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def recv(self) -> Message | None:
        message: Message = self._conn.recv()
        return message

    def send(self, reply: tuple[str, Any]) -> None:
        send_by_value(self._conn, reply)


def send_by_value(conn: Connection, message: Any) -> None:
    """`conn.send` with tensors pickled by value. The connection's own pickler (torch's
    multiprocessing reductions) sends a tensor as a shared-memory handle that only a related
    process may open: the engine and a Ray actor are not (KV blocks of disaggregated prefill
    travel both ways). The receiver's plain `recv` reads either."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def no_delay(conn: Connection) -> None:
    """Send small messages at once: a step is a few small messages each way, which Nagle's
    algorithm (with the peer's delayed ACKs) would hold for up to 40 ms."""
    with socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _start(
    config: EngineConfig, device_type: str, rank: int, size: int, init_method: str
) -> ModelRunner:
    if device_type == "cuda":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        # Ray sets this actor's threads to its CPU share (OMP_NUM_THREADS).
        device = torch.device("cpu")
        backend = "gloo"
    warm_up_compiler(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size)
    torch.manual_seed(config.model.seed)
    tp_ranks = tp_size(config)
    num_stages = config.parallel.pipeline_parallel_size
    if num_stages == 1:
        tp = TensorParallel(rank, tp_ranks, config.parallel.enable_expert_parallel)
        loaded = load_model(config.model, device, tp)
        return ModelRunner(loaded, config, device, tp)
    # Every rank creates every stage's group, in the same order.
    groups = [
        dist.new_group(list(range(s * tp_ranks, (s + 1) * tp_ranks))) for s in range(num_stages)
    ]
    tp = TensorParallel(
        rank % tp_ranks,
        tp_ranks,
        config.parallel.enable_expert_parallel,
        group=groups[rank // tp_ranks],
    )
    shape = load_model(config.model, torch.device("cpu"), tp, weights=False)
    stage = PipelineStage.of(rank, tp_ranks, num_stages, shape.arch.num_hidden_layers)
    loaded = load_model(config.model, device, tp, pp=stage)
    return ModelRunner(loaded, config, device, tp, stage)


def tp_size(config: EngineConfig) -> int:
    return config.parallel.tensor_parallel_size
