"""One tensor-parallel rank as a Ray actor (started by RayExecutor).

The actor is single-threaded, so its methods run in the order the engine called them, as
the messages of a MultiProcExecutor worker do over its pipe:

  address()    rank 0: where the process group meets (this node's IP, a free port)
  start(...)   join the group, load this rank's slice of the model
  forward      apply a plan and run its forward pass (an error is kept for `sample`)
  sample       sample the oldest forwarded step and collect it: ("ok", StepResult on
               rank 0, None elsewhere) or ("err", message)
  rpc          any ModelRunner method (KV pool sizing and allocation)

Ray gives each actor its own device (CUDA_VISIBLE_DEVICES holds one GPU), so every rank
runs on cuda:0 of its own view.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from asyncserve.config import EngineConfig
from asyncserve.core.step import GrammarBitmask, StepPlan
from asyncserve.executor.tp_worker import _error
from asyncserve.executor.tp_worker import _sample as sample_forwarded
from asyncserve.models.loader import load_model
from asyncserve.models.parallel import TensorParallel
from asyncserve.worker.model_runner import ForwardedStep, ModelRunner


class RayWorker:
    def __init__(self) -> None:
        self.runner: ModelRunner | None = None
        self.rank = 0
        # Forwarded steps waiting for their `sample` call (two with async scheduling).
        self.forwarded: deque[ForwardedStep | BaseException] = deque()

    def address(self) -> str:
        """A tcp:// address on this node for the process group's rendezvous."""
        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        return f"tcp://{host}:{port}"

    def where(self) -> tuple[str, int]:
        """(Ray node id, pid) of this rank."""
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()

    def start(
        self, config: EngineConfig, device_type: str, rank: int, size: int, init_method: str
    ) -> None:
        self.rank = rank
        if device_type == "cuda":
            device = torch.device("cuda", 0)
            torch.cuda.set_device(device)
            backend = "nccl"
        else:
            device = torch.device("cpu")
            backend = "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size)
        torch.manual_seed(config.model.seed)
        tp = TensorParallel(rank, size)
        loaded = load_model(config.model, device, tp)
        self.runner = ModelRunner(loaded, config, device, tp)

    def forward(self, plan: StepPlan) -> None:
        assert self.runner is not None
        try:
            self.forwarded.append(self.runner.launch_forward(plan))
        except Exception as exc:  # reported when the step is sampled
            self.forwarded.append(exc)

    def sample(self, bitmask: GrammarBitmask | None) -> tuple[str, Any]:
        assert self.runner is not None
        return sample_forwarded(self.runner, self.rank, self.forwarded.popleft(), bitmask)

    def rpc(self, method: str, args: tuple[Any, ...]) -> tuple[str, Any]:
        assert self.runner is not None
        try:
            return "ok", getattr(self.runner, method)(*args)
        except Exception as exc:
            return _error(exc)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
