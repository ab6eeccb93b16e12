"""A torch.distributed process group between a producer and a consumer, on which KV block
payloads travel (the P2pNcclConnector / PyNcclConnector of --kv-transfer-config).

World size 2, ranks from kv_rank; rank 0 hosts the TCPStore at kv_ip:kv_port, through which
the pair meets. Backend NCCL when the payload lives on a GPU (tensors go GPU to GPU, no host
copy), gloo on the CPU: the same code path either way.

All group work runs in order on one dedicated thread per instance, so the engine keeps
stepping while a transfer runs and at most one send/recv pair is in flight per pair of
instances (NCCL needs them to match). Each payload is preceded by a header naming its
transfer id and shape, so a stale payload is recognised instead of read as another's.

The group is formed lazily under a token the consumer picks: a pull names the token, and a
producer whose group has another one (or none) forms a new group under it. Any failure (a
dead peer, a timeout, a mismatched header) drops the group on that side and fails only that
transfer; the consumer then picks a new token for its next pull, as it does when another
producer (a restarted one: a new engine id) answers, so the pair re-forms. Each group op is bounded by `timeout_s`: gloo's own timeout, and for
NCCL a host-side wait on the work with the communicator aborted at the deadline.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from asyncserve.config import KVTransferConfig

logger = logging.getLogger(__name__)

# [transfer id, blocks, layers, 2, block_size, kv_heads, head_dim]
_HEADER_LEN = 7
_POLL_S = 0.0005


class KVGroupError(RuntimeError):
    """A group transfer that failed: the peer is gone, too slow, or out of step."""


class KVGroup:
    def __init__(self, config: KVTransferConfig, device: torch.device) -> None:
        # KVTransferConfig checked these for the group connectors.
        assert config.kv_ip and config.kv_port is not None and config.kv_rank is not None
        self.host, self.port, self.rank = config.kv_ip, config.kv_port, config.kv_rank
        self.peer = 1 - self.rank
        self.address = f"{self.host}:{self.port}"
        self.device = device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.timeout = datetime.timedelta(seconds=config.kv_group_timeout_s)
        self.token: str | None = None  # the formed group's
        self._next_token: str | None = None  # the consumer's for its next pull
        self._peer_id: str | None = None
        self._pg: Any = None
        self.groups_formed = 0  # each costs a communicator's setup (~1 s for NCCL)
        self._stream: Any = None
        self._lock = threading.Lock()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncserve-kv-group")
        self._server: dist.TCPStore | None = None
        if self.rank == 0:
            # Bound now, so a port in use is an error at start rather than at the first pull.
            self._server = dist.TCPStore(self.host, self.port, None, True, self.timeout,
                                         wait_for_workers=False)  # fmt: skip
        if self.backend == "nccl":
            # A timed-out NCCL op aborts its communicator instead of ending the process: only
            # that transfer fails (read by ProcessGroupNCCL when a group is made).
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")

    # ---- the engine's side: each returns at once -----------------------------------------

    def new_token(self, peer_id: str) -> str:
        """The token of this consumer's next pull from the producer `peer_id` (its engine
        id): the current group's while it is healthy and the peer the same, a new one (so a
        new group) after a failure or once a restarted peer answers."""
        with self._lock:
            if self._next_token is None or peer_id != self._peer_id:
                self._next_token, self._peer_id = uuid.uuid4().hex, peer_id
            return self._next_token

    def send(
        self, token: str, transfer_id: int, data: torch.Tensor, ready: Any = None
    ) -> Future[None]:
        """Send `data` ([blocks, layers, 2, block_size, heads, dim]) to the peer; `ready`: a
        CUDA event the data waits for (it was read on the step's stream)."""
        return self._thread.submit(self._run, token, self._send, transfer_id, data, ready)

    def recv(self, token: str, transfer_id: int, dtype: torch.dtype) -> Future[torch.Tensor]:
        """The peer's payload of this transfer."""
        return self._thread.submit(self._run, token, self._recv, transfer_id, dtype)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
        self._drop()

    # ---- the group thread ----------------------------------------------------------------

    def _run(self, token: str, op: Any, *args: Any) -> Any:
        try:
            self._join(token)
            with self._on_stream():
                return op(*args)
        except Exception as exc:
            self._drop()
            if isinstance(exc, KVGroupError):
                raise
            raise KVGroupError(f"the KV group at {self.address} ({self.backend}) failed: "
                               f"{str(exc).splitlines()[0] if str(exc) else exc!r}") from exc  # fmt: skip

    def _join(self, token: str) -> None:
        with self._lock:
            if self._pg is not None and self.token == token:
                return
        self._close_group()  # keeps the token: it names the group formed now
        client = dist.TCPStore(self.host, self.port, None, False, self.timeout,
                               wait_for_workers=False)  # fmt: skip
        store = dist.PrefixStore(f"asyncserve-kv/{token}", client)
        if self.backend == "nccl":
            pg: Any = dist.ProcessGroupNCCL(store, self.rank, 2, _nccl_options(self.timeout))
            self._stream = torch.cuda.Stream(self.device)
        else:
            pg = dist.ProcessGroupGloo(store, self.rank, 2, self.timeout)
        with self._lock:
            self._pg, self.token = pg, token
            self.groups_formed += 1
        if self.backend == "nccl":
            # NCCL sets up its communicator at the first op and waits for the peer there:
            # do it now, while the peer joins too, rather than inside a transfer.
            with self._on_stream():
                hello = torch.zeros(1, device=self.device)
                op = pg.send if self.rank == 0 else pg.recv
                self._wait(op([hello], self.peer, 2), "the group's setup")
        logger.info("KV group %s formed with rank %d (%s)", self.address, self.peer, self.backend)

    def _drop(self) -> None:
        """After a failure: the group goes, and the consumer's next pull picks a new token."""
        with self._lock:
            self._next_token = None
        self._close_group()

    def _close_group(self) -> None:
        with self._lock:
            pg, self._pg, self.token = self._pg, None, None
        if pg is not None and self.backend == "nccl":
            with contextlib.suppress(Exception):  # already broken: nothing more to free
                pg.abort()

    def _on_stream(self) -> Any:
        if self._stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._stream)

    def _send(self, transfer_id: int, data: torch.Tensor, ready: Any) -> None:
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)
        header = torch.tensor([transfer_id, *data.shape], dtype=torch.int64)
        self._wait(self._pg.send([header.to(self.device)], self.peer, 0), "header")
        if data.numel():
            self._wait(self._pg.send([data.to(self.device).contiguous()], self.peer, 1), "blocks")

    def _recv(self, transfer_id: int, dtype: torch.dtype) -> torch.Tensor:
        header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.device)
        self._wait(self._pg.recv([header], self.peer, 0), "header")
        got, *shape = header.tolist()
        if got != transfer_id or len(shape) != 6:
            raise KVGroupError(f"the KV group at {self.address} is out of step: transfer {got} "
                               f"arrived while {transfer_id} was expected")  # fmt: skip
        data = torch.empty(shape, dtype=dtype, device=self.device)
        if data.numel():
            self._wait(self._pg.recv([data], self.peer, 1), "blocks")
        return data

    def _wait(self, work: Any, what: str) -> None:
        if self.backend != "nccl":
            work.wait(self.timeout)  # gloo raises past its timeout or when the peer is gone
            return
        # NCCL: wait on the host with a deadline (work.wait only orders the streams).
        deadline = time.monotonic() + self.timeout.total_seconds()
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise KVGroupError(f"the KV group at {self.address}: {what} not done within "
                                   f"{self.timeout.total_seconds():g} s")  # fmt: skip
            time.sleep(_POLL_S)
        work.wait()  # raises the op's error, if any


def _nccl_options(timeout: datetime.timedelta) -> Any:
    options = dist.ProcessGroupNCCL.Options()
    # The communicator's own watchdog fires a little after the host-side deadline.
    options._timeout = timeout * 2
    # Set up without blocking the host, so a peer gone during setup is a deadline too.
    options.config.blocking = False
    return options
