"""The LoRA adapters of a DataParallelClient: checked once in the front end, registered on
every replica by a pipe message that each replica answers (dp_replica.py), removed likewise.

Answers are taken in the pipe-reading threads, not on the event loop: add_lora is
synchronous (vLLM's surface) and may be called before the loop runs (--lora-modules, LLM).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from asyncserve.config import LoRAConfig
from asyncserve.lora.adapter import load_adapter
from asyncserve.lora.layers import ModuleShapes
from asyncserve.lora.request import LoRARequest

# How long add_lora / remove_lora wait for every replica's answer (a replica answers
# between two of its steps, after reading the adapter from disk).
LORA_TIMEOUT_S = 120.0


class ReplicaLoRAs:
    def __init__(
        self,
        config: LoRAConfig,
        shapes: ModuleShapes,
        dtype: torch.dtype,
        size: int,
        send: Callable[[int, tuple[Any, ...]], bool],
        alive: Callable[[int], bool],
    ) -> None:
        self.config = config
        self.shapes = shapes
        self.dtype = dtype
        self.size = size
        self._send = send
        self._alive = alive
        # Validated adapters by lora_int_id (each replica registers its own as well).
        self.loras: dict[int, LoRARequest] = {}
        # Each replica's adapter ids as its last answer named them.
        self.replica_loras: list[list[int]] = [[] for _ in range(size)]
        # Messages waiting for a replica's answer: seq -> (replica, future).
        self._waits: dict[int, tuple[int, Future[str | None]]] = {}
        self._seq = itertools.count()
        self._lock = threading.Lock()

    def check(self, lora_request: LoRARequest) -> bool:
        """Validate an adapter here (as AsyncEngine.add_lora does) and remember it; False
        when it is known already. ValueError naming what is wrong."""
        if not self.config.enable_lora:
            raise ValueError("lora_request: LoRA is not enabled (enable_lora=True / --enable-lora)")
        known = self.loras.get(lora_request.lora_int_id)
        if known is not None:
            if (known.lora_name, known.lora_path) != (
                lora_request.lora_name,
                lora_request.lora_path,
            ):
                raise ValueError(
                    f"lora_int_id {lora_request.lora_int_id} is already used by adapter "
                    f"{known.lora_name!r} at {known.lora_path!r}"
                )
            return False
        load_adapter(
            lora_request.lora_name,
            lora_request.lora_path,
            self.shapes,
            self.config.max_lora_rank,
            self.dtype,
        )
        self.loras[lora_request.lora_int_id] = lora_request
        return True

    def add(self, lora_request: LoRARequest) -> bool:
        """Check once here, then register on every replica and wait for their answers."""
        if not self.check(lora_request):
            return False
        errors = self._to_every_replica("lora_add", lora_request)
        if errors:
            self.remove(lora_request.lora_int_id)
            raise ValueError(errors[0])
        return True

    def remove(self, lora_int_id: int) -> bool:
        if self.loras.pop(lora_int_id, None) is None:
            return False
        self._to_every_replica("lora_remove", lora_int_id)
        return True

    def _to_every_replica(self, kind: str, payload: Any) -> list[str]:
        """Send (kind, seq, payload) to each live replica and wait for every answer; the
        errors they name."""
        waits: list[tuple[int, Future[str | None]]] = []
        errors: list[str] = []
        for index in range(self.size):
            if not self._alive(index):
                continue
            future: Future[str | None] = Future()
            with self._lock:
                seq = next(self._seq)
                self._waits[seq] = (index, future)
            if self._send(index, (kind, seq, payload)):
                waits.append((index, future))
            else:
                with self._lock:
                    self._waits.pop(seq, None)
                errors.append(f"data-parallel replica {index} is not running")
        for index, future in waits:
            try:
                error = future.result(LORA_TIMEOUT_S)
            except TimeoutError:
                error = f"data-parallel replica {index} did not answer in {LORA_TIMEOUT_S} s"
            if error is not None:
                errors.append(error)
        return errors

    def on_answer(self, index: int, message: tuple[Any, ...]) -> None:
        """("lora", seq, error or None, ids) from replica `index` (a reading thread)."""
        with self._lock:
            wait = self._waits.pop(message[1], None)
        self.replica_loras[index] = message[3]
        if wait is not None:
            wait[1].set_result(message[2])

    def on_exit(self, index: int, code: int | None) -> None:
        """Replica `index` has exited: what waits for its answer fails now."""
        with self._lock:
            ended = [seq for seq, (replica, _) in self._waits.items() if replica == index]
            futures = [self._waits.pop(seq)[1] for seq in ended]
        for future in futures:
            future.set_result(f"data-parallel replica {index} exited (exit code {code})")
