"""DataParallelClient: N engine replicas, each in its own process on its own devices, behind
the surface the HTTP server and LLM use of AsyncEngine (http/engine_client.py).

The front end (this process) tokenizes and checks requests, processes their images (the
replica gets the expanded prompt and the CPU tensors its encoder takes), picks a replica
(engine/dp_balancer.py), sends the request down that replica's pipe and hands the outputs
that come back to the caller's mailbox. A replica that dies fails its requests with an
error naming it and the client reports itself dead (/health 503, the server exits 1).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from asyncserve.config import EngineConfig
from asyncserve.core.grammar import StructuredOutputManager
from asyncserve.engine.dp_balancer import ReplicaBalancer
from asyncserve.engine.dp_lora import ReplicaLoRAs
from asyncserve.engine.dp_processes import EXIT_GRACE_S, ReplicaProcesses, replica_devices
from asyncserve.engine.dp_replica import Stats
from asyncserve.engine.multimodal import MultiModalFrontEnd
from asyncserve.engine.request_checks import check_priority, check_request, truncate_prompt
from asyncserve.engine.setup import eos_token_ids, resolve_device
from asyncserve.lora.layers import module_shapes
from asyncserve.lora.request import LoRARequest
from asyncserve.models.loader import load_model
from asyncserve.models.parallel import TensorParallel
from asyncserve.multimodal.inputs import MultiModalInputs
from asyncserve.output.request_stream import RequestStream
from asyncserve.outputs import CompletionOutput, RequestOutput
from asyncserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_METRICS_TIMEOUT_S = 5.0


@dataclass
class _Tracked:
    replica: int
    cost: int
    stream: RequestStream
    prompt_text: str | None
    prompt_ids: list[int]
    n: int


class DataParallelClient:
    def __init__(self, config: EngineConfig, model_name: str = "model") -> None:
        dp = config.parallel.data_parallel_size
        tp = config.parallel.tensor_parallel_size
        device = resolve_device(config.model.device)
        devices = replica_devices(dp, tp, device)
        self.config = config
        self.device = device
        self.size = dp
        self.balancer = ReplicaBalancer(dp, config.cache.block_size)
        self._requests: dict[str, _Tracked] = {}
        self._stats: list[Stats] = [(0, 0, 0.0, 0, 0)] * dp
        self._metric_waits: dict[int, asyncio.Future[Any]] = {}
        self._seq = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: asyncio.Event | None = None
        self._dead_reason: str | None = None
        self._replica_reasons: dict[int, str] = {}
        self._closing = False
        self._closed = False
        self._started = False
        # Messages read before start() gave an event loop, replayed there by start().
        self._early: list[tuple[Any, ...]] = []
        self._early_lock = threading.Lock()
        self._replicas = ReplicaProcesses(config, devices, model_name)
        # Before multiprocessing's own exit handler, which would wait forever for replicas
        # that wait for this end of their pipes to close.
        atexit.register(self._end_at_exit)
        try:
            # Config, tokenizer and checks (TP's shape checks too) here while the replicas
            # load their weights.
            self.loaded = load_model(
                config.model, torch.device("cpu"), TensorParallel(0, tp), weights=False
            )
            self._replicas.wait_ready()
        except BaseException:
            self._end()
            raise
        shapes = module_shapes(self.loaded.model) if config.lora.enable_lora else {}
        self.lora = ReplicaLoRAs(
            config.lora,
            shapes,
            self.loaded.dtype,
            dp,
            self._send,
            lambda index: self.balancer.alive[index],
        )
        # Read from now on: adapters are registered (answered) before the loop starts.
        self._replicas.start_readers(self._from_reader, self._exit_from_reader)
        self.tokenizer = self.loaded.tokenizer
        self.model_path = self.loaded.model_path
        self.generation_config = self.loaded.generation_config
        arch = self.loaded.arch
        self.max_model_len = min(
            config.model.max_model_len or arch.max_position_embeddings,
            arch.max_position_embeddings,
        )
        self.eos_token_ids = eos_token_ids(self.loaded, self.tokenizer.eos_token_id)
        self.multimodal = MultiModalFrontEnd.build(self.loaded, config)
        # Grammars compile here too, so a bad one is refused before a replica sees it.
        self.structured = StructuredOutputManager(
            self.tokenizer.backend, arch.vocab_size, self.eos_token_ids, pin_memory=False
        )
        logger.info("%d data-parallel replicas ready (pids %s)", dp, self.pids)

    @property
    def pids(self) -> list[int]:
        return self._replicas.pids

    # ---- state for the server ------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._started and self._dead_reason is None and not self._closed

    @property
    def num_running(self) -> int:
        return sum(s[0] for s in self._stats)

    @property
    def num_waiting(self) -> int:
        return sum(s[1] for s in self._stats)

    @property
    def kv_cache_usage(self) -> float:
        return sum(s[2] for s in self._stats) / self.size

    @property
    def num_free_blocks(self) -> int:
        return sum(s[3] for s in self._stats)

    @property
    def num_total_blocks(self) -> int:
        return sum(s[4] for s in self._stats)

    def replica_stats(self) -> list[Stats]:
        return list(self._stats)

    # ---- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        if self._started:
            return
        if self._closed:
            raise RuntimeError("the data-parallel engine has been shut down")
        self._started = True
        self._dead = asyncio.Event()
        with self._early_lock:
            self._loop = loop = asyncio.get_running_loop()
            early, self._early = self._early, []
        for message in early:
            loop.call_soon(*message)

    async def wait_until_dead(self) -> str:
        if self._dead is None:
            await self.start()
        assert self._dead is not None
        await self._dead.wait()
        return self._dead_reason or "a data-parallel replica stopped"

    async def shutdown(self, timeout: float | None = None) -> None:
        """Every replica lets its running requests finish for up to `timeout` seconds, aborts
        the rest and exits; a replica that does not is ended."""
        if self._closed:
            return
        self._closing = True
        for index in range(self.size):
            self._send(index, ("shutdown", timeout))
        limit = None if timeout is None else timeout + 2 * EXIT_GRACE_S
        await asyncio.to_thread(self._replicas.join, limit)
        atexit.unregister(self._end_at_exit)
        self._closed = True
        # The replicas' last outputs are delivered by now (their pipes are read to the end).
        await asyncio.sleep(0)

    async def close(self) -> None:
        await self.shutdown(timeout=0)

    def _end_at_exit(self) -> None:
        if not self._closed:
            self._closing = True
            for index in range(self.size):
                self._send(index, ("shutdown", 0.0))
            self._replicas.join(EXIT_GRACE_S)
            self._closed = True

    def _end(self) -> None:
        self._closing = True
        self._replicas.terminate()
        atexit.unregister(self._end_at_exit)

    # ---- requests ------------------------------------------------------------------------

    def validate_request(
        self, prompt_token_ids: list[int], params: SamplingParams, strict_max_tokens: bool = True
    ) -> None:
        check_request(
            prompt_token_ids,
            params,
            self.loaded.arch.vocab_size,
            self.max_model_len,
            self.structured,
            strict_max_tokens,
        )

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        trace_headers: Mapping[str, str] | None = None,
        lora_request: LoRARequest | None = None,
        mm_inputs: MultiModalInputs | None = None,
    ) -> RequestStream:
        """`mm_inputs`: the prompt's images, processed (self.multimodal.process); its
        expanded token ids replace the prompt's."""
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        check_priority(priority)
        if self._dead_reason is not None:
            raise RuntimeError(f"engine is not running: {self._dead_reason}")
        if isinstance(prompt, str):
            prompt_text: str | None = prompt
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            prompt_text = None
            ids = list(prompt)
        if mm_inputs is not None:
            ids = list(mm_inputs.prompt_token_ids)  # images are never truncated away
        else:
            ids = truncate_prompt(ids, params, self.max_model_len)
            self.multimodal.check_text_prompt(ids)
        self.validate_request(ids, params, strict_max_tokens=False)
        lora_id = 0
        if lora_request is not None:
            # Checked here; the replica registers it with the request if it is new there.
            self.lora.check(lora_request)
            lora_id = lora_request.lora_int_id
        room = self.max_model_len - len(ids)
        most = room if params.max_tokens is None else min(params.max_tokens, room)
        cost = (len(ids) + most) * params.n
        extra_keys = mm_inputs.features.block_extra_keys if mm_inputs is not None else None
        index = self.balancer.choose(ids, cost, lora_id, extra_keys)
        stream = RequestStream(request_id, params.output_kind)
        self._requests[request_id] = _Tracked(index, cost, stream, prompt_text, ids, params.n)
        # The replica truncates nothing more: `ids` are already the prompt it runs.
        if params.truncate_prompt_tokens is not None:
            params = _without_truncation(params)
        headers = dict(trace_headers) if trace_headers else None
        message = ("add", request_id, ids, params, priority, headers, lora_request, mm_inputs)
        self._send(index, message)
        return stream

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
        trace_headers: Mapping[str, str] | None = None,
        lora_request: LoRARequest | None = None,
        mm_inputs: MultiModalInputs | None = None,
    ) -> AsyncIterator[RequestOutput]:
        if not self._started:
            await self.start()
        stream = self.add_request(
            prompt, sampling_params, request_id, priority, trace_headers, lora_request, mm_inputs
        )
        try:
            while True:
                output = await stream.get()
                yield output
                if output.finished:
                    return
        finally:
            if not stream.finished:
                await self.abort(request_id)

    # ---- LoRA adapters --------------------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Validate an adapter once here, then register it on every replica and wait for
        their answers (ValueError naming a problem); False when it is registered already.
        Blocks: the HTTP routes call it off the event loop."""
        if self._dead_reason is not None:
            raise RuntimeError(f"engine is not running: {self._dead_reason}")
        return self.lora.add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter here and on every replica (answered)."""
        return self.lora.remove(lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        return list(self.lora.loras.values())

    async def abort(self, request_id: str) -> None:
        # The replica answers with the request's last output, which ends it here too.
        tracked = self._requests.get(request_id)
        if tracked is not None:
            self._send(tracked.replica, ("abort", request_id))

    async def metrics_snapshots(self) -> dict[int, list[Any]]:
        """Each live replica's metric families (prometheus_client Metric objects)."""
        assert self._loop is not None
        waits: dict[int, asyncio.Future[Any]] = {}
        for index in range(self.size):
            if not self.balancer.alive[index]:
                continue
            seq = next(self._seq)
            future = self._loop.create_future()
            self._metric_waits[seq] = future
            if self._send(index, ("metrics", seq)):
                waits[index] = future
            else:
                self._metric_waits.pop(seq)
        out: dict[int, list[Any]] = {}
        for index, future in waits.items():
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                out[index] = await asyncio.wait_for(future, _METRICS_TIMEOUT_S)
        return out

    # ---- pipes ---------------------------------------------------------------------------

    def _send(self, index: int, message: tuple[Any, ...]) -> bool:
        return self._replicas.send(index, message)

    def _from_reader(self, index: int, message: tuple[Any, ...]) -> None:
        if message[0] == "lora":  # answered in the reading thread: add_lora may block a loop
            self.lora.on_answer(index, message)
            return
        self._to_loop(self._on_message, index, message)

    def _exit_from_reader(self, index: int, pid: int | None, code: int | None) -> None:
        self.lora.on_exit(index, code)
        self._to_loop(self._on_exit, index, pid, code)

    def _to_loop(self, *call: Any) -> None:
        with self._early_lock:
            loop = self._loop
            if loop is None:
                self._early.append(call)
                return
        with contextlib.suppress(RuntimeError):  # the loop has closed
            loop.call_soon_threadsafe(*call)

    def _on_message(self, index: int, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "outs":
            self._stats[index] = message[2]
            for output in message[1]:
                self._deliver(output)
        elif kind == "stats":
            self._stats[index] = message[1]
        elif kind == "metrics":
            self._stats[index] = message[3]
            future = self._metric_waits.pop(message[1], None)
            if future is not None and not future.done():
                future.set_result(message[2])
        elif kind == "dead":
            self._replica_reasons[index] = message[1]

    def _deliver(self, output: RequestOutput) -> None:
        tracked = self._requests.get(output.request_id)
        if tracked is None:
            return
        if tracked.prompt_text is not None:
            output.prompt = tracked.prompt_text
        tracked.stream.put(output)
        if output.finished:
            del self._requests[output.request_id]
            self.balancer.release(tracked.replica, tracked.cost)

    def _on_exit(self, index: int, pid: int | None, code: int | None) -> None:
        self.balancer.mark_dead(index)
        cause = self._replica_reasons.get(index)
        died = not self._closing or cause is not None
        if cause is not None:
            reason = f"data-parallel replica {index} failed: {cause}"
        elif died:
            reason = f"data-parallel replica {index} (pid {pid}) died (exit code {code})"
        else:
            reason = "the engine shut down"
        # Its requests that got no last output end here, with the reason.
        for request_id, tracked in list(self._requests.items()):
            if tracked.replica == index:
                del self._requests[request_id]
                tracked.stream.put(_failed(request_id, tracked, reason))
        if not died:
            return
        logger.error("%s", reason)
        if self._dead_reason is None:
            self._dead_reason = reason
        if self._dead is not None:
            self._dead.set()


def _without_truncation(params: SamplingParams) -> SamplingParams:
    import copy

    params = copy.copy(params)
    params.truncate_prompt_tokens = None
    return params


def _failed(request_id: str, tracked: _Tracked, reason: str) -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        prompt=tracked.prompt_text,
        prompt_token_ids=tracked.prompt_ids,
        outputs=[
            CompletionOutput(index=i, text="", token_ids=[], finish_reason="error")
            for i in range(tracked.n)
        ],
        finished=True,
        error=reason,
    )
