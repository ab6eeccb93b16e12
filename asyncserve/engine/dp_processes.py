"""The data-parallel replica processes of one DataParallelClient: spawn, wait until loaded,
send, read (one thread per replica, so a replica never blocks on a full pipe), end."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from multiprocessing import get_context
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from asyncserve.config import EngineConfig, Environment
from asyncserve.engine.dp_replica import replica_main

# Seconds a replica gets to exit on its own before it is terminated.
EXIT_GRACE_S = 5.0


def replica_devices(dp: int, tp: int, device: torch.device) -> list[list[str]] | None:
    """The CUDA devices of each replica (replica r: visible devices r*TP .. r*TP+TP-1), or
    None off CUDA. One-line ValueError when DP x TP exceeds the visible devices."""
    if device.type != "cuda":
        return None
    count = torch.cuda.device_count()
    if dp * tp > count:
        raise ValueError(
            f"data_parallel_size x tensor_parallel_size ({dp} x {tp} = {dp * tp}) exceeds the "
            f"{count} visible CUDA devices"
        )
    visible = Environment.read().cuda_visible_devices
    ids = list(visible) if visible else [str(i) for i in range(count)]
    return [ids[r * tp : (r + 1) * tp] for r in range(dp)]


class ReplicaProcesses:
    def __init__(
        self, config: EngineConfig, devices: list[list[str]] | None, model_name: str
    ) -> None:
        size = config.parallel.data_parallel_size
        self.size = size
        self.procs: list[BaseProcess] = []
        self._conns: list[Connection] = []
        self._readers: list[threading.Thread] = []
        self._send_locks = [threading.Lock() for _ in range(size)]
        cpu_threads = None if devices is not None else max(1, (os.cpu_count() or 1) // size)
        log_level = logging.getLogger("asyncserve").getEffectiveLevel()
        ctx = get_context("spawn")
        for index in range(size):
            parent, child = ctx.Pipe()
            # Not daemonic: a replica with TP > 1 starts its own worker processes. It exits
            # when this end of its pipe closes (this process ended).
            proc = ctx.Process(
                target=replica_main,
                args=(
                    config,
                    index,
                    None if devices is None else devices[index],
                    cpu_threads,
                    model_name,
                    log_level,
                    child,
                ),
                name=f"asyncserve-dp{index}",
            )
            proc.start()
            child.close()  # only the replica holds its end: its exit reads as EOF here
            self.procs.append(proc)
            self._conns.append(parent)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def wait_ready(self) -> None:
        """Every replica reports once its engine is up; a failure names the replica."""
        sentinels = [p.sentinel for p in self.procs]
        for index, conn in enumerate(self._conns):
            while not conn.poll():
                wait([conn, *sentinels])
                if not conn.poll():
                    self._raise_if_exited(sentinels)
            try:
                kind, value = conn.recv()
            except (EOFError, OSError):
                self.procs[index].join(EXIT_GRACE_S)
                self._raise_if_exited(sentinels)
                raise RuntimeError(f"data-parallel replica {index} closed its pipe") from None
            if kind != "ready":
                raise RuntimeError(f"data-parallel replica {index} failed to start: {value}")

    def _raise_if_exited(self, sentinels: list[Any]) -> None:
        ended = wait(sentinels, timeout=0)
        for index, proc in enumerate(self.procs):
            if proc.sentinel in ended:
                proc.join(EXIT_GRACE_S)
                raise RuntimeError(
                    f"data-parallel replica {index} exited while loading (exit code "
                    f"{proc.exitcode})"
                )

    def send(self, index: int, message: tuple[Any, ...]) -> bool:
        """False when the replica is gone (its death is reported by its reader)."""
        try:
            with self._send_locks[index]:
                self._conns[index].send(message)
            return True
        except (OSError, ValueError):
            return False

    def start_readers(
        self,
        on_message: Callable[[int, tuple[Any, ...]], None],
        on_exit: Callable[[int, int | None, int | None], None],
    ) -> None:
        """One thread per replica reads its pipe to the end and calls on_message for each
        message, then on_exit(index, pid, exit code), from the reading thread."""
        for index in range(self.size):
            reader = threading.Thread(
                target=self._read,
                args=(index, on_message, on_exit),
                name=f"asyncserve-dp{index}-read",
                daemon=True,
            )
            reader.start()
            self._readers.append(reader)

    def _read(
        self,
        index: int,
        on_message: Callable[[int, tuple[Any, ...]], None],
        on_exit: Callable[[int, int | None, int | None], None],
    ) -> None:
        conn, proc = self._conns[index], self.procs[index]
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError, TypeError, ValueError):  # ended, or closed here
                break
            on_message(index, message)
        proc.join(EXIT_GRACE_S)
        on_exit(index, proc.pid, proc.exitcode)

    def join(self, limit: float | None) -> None:
        """Wait up to `limit` seconds (None: no limit) for every replica to exit, then end
        the ones left."""
        deadline = None if limit is None else time.monotonic() + limit
        while True:
            pending = [p.sentinel for p in self.procs if p.exitcode is None and p.is_alive()]
            if not pending:
                break
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            wait(pending, timeout=left)
        self.terminate()

    def terminate(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()  # replicas ignore SIGTERM (dp_replica.py)
            proc.join()
        # The readers pass on what the replicas sent before they ended, then see EOF.
        for reader in self._readers:
            reader.join(EXIT_GRACE_S)
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.close()
