"""The main of one data-parallel replica process (started by DataParallelClient).

The replica runs the whole engine (scheduler, step loop, output processing, and its own
tensor-parallel workers when TP > 1) on its own devices, so replicas share no GIL. It talks
to the front end over one pipe, both ways as pickled tuples:

  front -> replica   ("add", request_id, prompt_ids, params, priority, trace_headers,
                      lora_request, mm_inputs)   (MultiModalInputs: CPU tensors)
                     ("lora_add", seq, LoRARequest)    -> ("lora", seq, error, ids)
                     ("lora_remove", seq, lora_int_id) -> ("lora", seq, None, ids)
                     (error: a message or None; ids: the replica's adapter ids after it)
                     ("abort", request_id)
                     ("metrics", seq)             -> ("metrics", seq, families, stats)
                     ("shutdown", timeout)        -> finishes, then ("closed",) and exits 0
  replica -> front   ("ready", None) | ("failed", reason)       once, after the load
                     ("outs", [RequestOutput, ...], stats)       batched per loop turn
                     ("stats", stats)                            when idle stats change
                     ("dead", reason)                            the engine failed: exit 1

A thread reads the pipe whatever the event loop is doing, so neither side can block the
other's sends. The replica exits when the front end's end of the pipe closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
import traceback
from multiprocessing.connection import Connection
from typing import Any

from asyncserve.config import EngineConfig
from asyncserve.outputs import RequestOutput

logger = logging.getLogger(__name__)

# (num_running, num_waiting, kv_cache_usage, num_free_blocks, num_total_blocks)
Stats = tuple[int, int, float, int, int]
_STATS_INTERVAL_S = 0.25


def replica_main(
    config: EngineConfig,
    index: int,
    devices: list[str] | None,
    cpu_threads: int | None,
    model_name: str,
    log_level: int,
    conn: Connection,
) -> None:
    # Ctrl-C and a service manager's SIGTERM reach the whole process group: the front end
    # drains, then ends the replicas (a "shutdown" message, or its pipe closing); a replica
    # that died of the signal first would fail the requests still running. SIG_IGN carries
    # over to this replica's own TP workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Before anything touches CUDA: this replica sees only its own devices (as 0..TP-1).
    if devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    # A spawned process starts without the server's logging setup: the same level, and the
    # replica named on each line.
    logging.basicConfig(
        level=log_level, format=f"%(levelname)s %(asctime)s dp{index} %(name)s: %(message)s"
    )
    import torch

    from asyncserve.engine.async_engine import AsyncEngine
    from asyncserve.metrics import EngineMetrics

    if cpu_threads is not None:
        torch.set_num_threads(cpu_threads)
    local = dataclasses.replace(
        config, parallel=dataclasses.replace(config.parallel, data_parallel_size=1)
    )
    metrics = EngineMetrics(model_name)
    try:
        engine = AsyncEngine.from_config(local, metrics)
    except Exception as exc:
        traceback.print_exception(exc)
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        sys.exit(1)
    conn.send(("ready", None))
    replica = _Replica(engine, metrics, conn)
    code = asyncio.run(replica.run())
    conn.close()
    sys.exit(code)


class _Replica:
    def __init__(self, engine: Any, metrics: Any, conn: Connection) -> None:
        self.engine = engine
        self.metrics = metrics
        self.conn = conn
        self.outbox: list[RequestOutput] = []
        self.pumps: set[asyncio.Task[None]] = set()
        self.send_lock = threading.Lock()
        self.done: asyncio.Future[int] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stopping = False

    def stats(self) -> Stats:
        e = self.engine
        return (
            e.num_running,
            e.num_waiting,
            e.kv_cache_usage,
            e.num_free_blocks,
            e.num_total_blocks,
        )

    def send(self, message: tuple[Any, ...]) -> None:
        with self.send_lock, contextlib.suppress(OSError):  # the front end is gone: we exit
            self.conn.send(message)

    async def run(self) -> int:
        self.loop = asyncio.get_running_loop()
        self.done = self.loop.create_future()
        await self.engine.start()
        threading.Thread(target=self._read, name="asyncserve-dp-read", daemon=True).start()
        watcher = asyncio.create_task(self._watch_engine())
        ticker = asyncio.create_task(self._send_stats())
        try:
            return await self.done
        finally:
            watcher.cancel()
            ticker.cancel()

    # ---- messages from the front end -----------------------------------------------------

    def _read(self) -> None:
        assert self.loop is not None
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                message = ("gone",)
            with contextlib.suppress(RuntimeError):  # the loop has closed: we are exiting
                self.loop.call_soon_threadsafe(self._handle, message)
            # Not at "shutdown": aborts that follow it (streams cut at the server's deadline)
            # must still reach the draining engine, else it waits out the whole timeout.
            if message[0] == "gone":
                return

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "add":
            self._add(*message[1:])
        elif kind == "abort":
            asyncio.ensure_future(self.engine.abort(message[1]))
        elif kind == "lora_add":
            asyncio.ensure_future(self._add_lora(message[1], message[2]))
        elif kind == "lora_remove":
            self.engine.remove_lora(message[2])
            self.send(("lora", message[1], None, self._lora_ids()))
        elif kind == "metrics":
            self.metrics.on_step(*self.stats()[:3])
            families = list(self.metrics.registry.collect())
            self.send(("metrics", message[1], families, self.stats()))
        elif kind in ("shutdown", "gone") and not self.stopping:  # the first one decides
            self.stopping = True
            if kind == "shutdown":
                asyncio.ensure_future(self._shutdown(message[1]))
            else:
                asyncio.ensure_future(self._shutdown(0.0, reply=False))

    def _add(
        self,
        request_id: str,
        prompt: list[int],
        params: Any,
        priority: int,
        trace_headers: dict[str, str] | None = None,
        lora_request: Any = None,
        mm_inputs: Any = None,
    ) -> None:
        try:
            stream = self.engine.add_request(
                prompt, params, request_id, priority, trace_headers, lora_request, mm_inputs
            )
        except (ValueError, RuntimeError) as exc:
            self.outbox.append(_error_output(request_id, prompt, str(exc), params.n))
            self._schedule_flush()
            return
        task = asyncio.ensure_future(self._pump(stream))
        self.pumps.add(task)
        task.add_done_callback(self.pumps.discard)

    async def _add_lora(self, seq: int, lora_request: Any) -> None:
        try:
            # Reads the adapter from disk: off the loop, so running requests keep stepping.
            await asyncio.to_thread(self.engine.add_lora, lora_request)
            error = None
        except (ValueError, RuntimeError, OSError) as exc:
            error = str(exc)
        self.send(("lora", seq, error, self._lora_ids()))

    def _lora_ids(self) -> list[int]:
        return sorted(r.lora_int_id for r in self.engine.list_loras())

    async def _pump(self, stream: Any) -> None:
        while True:
            output = await stream.get()
            self.outbox.append(output)
            self._schedule_flush()
            if output.finished:
                return

    # ---- outputs to the front end --------------------------------------------------------

    def _schedule_flush(self) -> None:
        if len(self.outbox) == 1:  # the first of this loop turn: flush once the turn ends
            assert self.loop is not None
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        if self.outbox:
            batch, self.outbox = self.outbox, []
            self.send(("outs", batch, self.stats()))

    async def _send_stats(self) -> None:
        """Stats go with every output batch; this keeps them current once the outputs stop
        (the front end's /health and waiting-request limit read them)."""
        last: Stats | None = None
        while True:
            await asyncio.sleep(_STATS_INTERVAL_S)
            stats = self.stats()
            if stats != last:
                self.send(("stats", stats))
                last = stats

    async def _drain(self, timeout: float) -> None:
        """Let the request pumps pass on their last outputs, then send them."""
        if self.pumps:
            await asyncio.wait(list(self.pumps), timeout=timeout)
        self._flush()

    async def _watch_engine(self) -> None:
        reason = await self.engine.wait_until_dead()
        await self._drain(5.0)  # every request's error output goes out first
        self.send(("dead", reason))
        await self.engine.close()
        self._finish(1)

    async def _shutdown(self, timeout: float, reply: bool = True) -> None:
        await self.engine.shutdown(timeout=timeout)
        await self._drain(5.0)
        await self.engine.close()
        if reply:
            self.send(("closed",))
        self._finish(0)

    def _finish(self, code: int) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result(code)


def _error_output(request_id: str, prompt: list[int], error: str, n: int) -> RequestOutput:
    from asyncserve.outputs import CompletionOutput

    return RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=prompt,
        outputs=[
            CompletionOutput(index=i, text="", token_ids=[], finish_reason="error")
            for i in range(n)
        ],
        finished=True,
        error=error,
    )
