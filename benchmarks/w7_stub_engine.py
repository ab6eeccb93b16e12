"""W7 benchmark fixture: an engine stand-in that emits one token every 20 ms per request.

For benchmarks/w7_http.py only: it measures the HTTP layer (parsing, SSE framing, the event
loop) without a model. It follows AsyncEngine's public interface, and like the real engine it
has one step loop that publishes every running request's token each tick through the real
per-request mailbox (asyncserve.output.request_stream.RequestStream).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from asyncserve.config import EngineConfig
from asyncserve.output.request_stream import RequestStream
from asyncserve.outputs import CompletionOutput, RequestOutput
from asyncserve.sampling_params import RequestOutputKind, SamplingParams

WORDS = [" the", " quick", " brown", " fox", " jumps", " over", " a", " lazy", " dog", "."]


class ByteTokenizer:
    """UTF-8 bytes as token ids (3..258); 0..2 are <pad>, <s>, </s>."""

    eos_token_id = 2
    bos_token_id = 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [b + 3 for b in text.encode("utf-8")]
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i - 3 for i in ids if i >= 3).decode("utf-8", errors="replace")

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        text = "".join(f"<|{m['role']}|>\n{m.get('content') or ''}\n" for m in messages)
        return text + ("<|assistant|>\n" if add_generation_prompt else "")


@dataclass
class _Active:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: RequestStream
    max_tokens: int
    generated: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)


class StubEngine:
    """Every `tick_s`, each running request gets one token (one word), until max_tokens."""

    def __init__(self, tick_s: float = 0.020, max_model_len: int = 4096) -> None:
        self.config = EngineConfig()
        self.tokenizer = ByteTokenizer()
        self.model_path = "w7-stub"
        self.max_model_len = max_model_len
        self.generation_config: dict[str, Any] = {}
        self.tick_s = tick_s
        self._active: dict[str, _Active] = {}
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def num_running(self) -> int:
        return len(self._active)

    @property
    def num_waiting(self) -> int:
        return 0

    kv_cache_usage = 0.0
    num_free_blocks = 0
    num_total_blocks = 0

    async def start(self) -> None:
        if not self.is_running:
            self._stopping = False
            self._task = asyncio.create_task(self._loop())

    async def shutdown(self, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (timeout or 0.0)
        while self._active and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for request_id in list(self._active):
            await self.abort(request_id)
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def wait_until_dead(self) -> str:
        # The stub never fails: wait for good (the server cancels this at shutdown).
        await asyncio.Event().wait()
        return "unreachable"

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        if params.max_tokens is not None and (
            len(prompt_token_ids) + params.max_tokens > self.max_model_len
        ):
            raise ValueError(
                f"max_tokens: the context is {self.max_model_len} tokens, but "
                f"{len(prompt_token_ids) + params.max_tokens} were requested"
            )

    def add_lora(self, lora_request: Any) -> bool:
        raise ValueError("the stub engine serves no LoRA adapters")

    def remove_lora(self, lora_int_id: int) -> bool:
        return False

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
        trace_headers: Mapping[str, str] | None = None,
        lora_request: Any = None,
    ) -> AsyncIterator[RequestOutput]:
        if lora_request is not None:
            raise ValueError("the stub engine serves no LoRA adapters")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        stream = RequestStream(request_id, sampling_params.output_kind)
        max_tokens = sampling_params.max_tokens or (self.max_model_len - len(ids))
        self._active[request_id] = _Active(request_id, ids, sampling_params, stream, max_tokens)
        try:
            while True:
                output = await stream.get()
                yield output
                if output.finished:
                    return
        finally:
            self._active.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        active = self._active.pop(request_id, None)
        if active is not None:
            active.stream.put(self._output(active, "abort", delta_text=""))

    def _output(self, a: _Active, finish: str | None, delta_text: str) -> RequestOutput:
        kind = a.params.output_kind
        if kind == RequestOutputKind.DELTA:
            text, ids = delta_text, a.generated[-1:] if delta_text else []
        else:
            text, ids = "".join(a.text), list(a.generated)
        outputs = [
            CompletionOutput(index=i, text=text, token_ids=list(ids), finish_reason=finish)
            for i in range(a.params.n)
        ]
        return RequestOutput(a.request_id, None, a.prompt_ids, outputs, finished=finish is not None)

    async def _loop(self) -> None:
        next_tick = time.monotonic()
        while not self._stopping:
            next_tick += self.tick_s
            for a in list(self._active.values()):
                word = WORDS[len(a.generated) % len(WORDS)]
                a.generated.append(3 + len(a.generated) % 200)
                a.text.append(word)
                finish = "length" if len(a.generated) >= a.max_tokens else None
                if finish is not None:
                    del self._active[a.request_id]
                if a.params.output_kind != RequestOutputKind.FINAL_ONLY or finish is not None:
                    a.stream.put(self._output(a, finish, word))
            await asyncio.sleep(max(0.0, next_tick - time.monotonic()))
