"""What the HTTP server needs from an engine (asyncserve.engine.async_engine.AsyncEngine).

A structural type, so the server is typed against the engine's public surface only, and the
W7 benchmark's stub engine can stand in for it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol

from asyncserve.config import EngineConfig
from asyncserve.lora.request import LoRARequest
from asyncserve.outputs import RequestOutput
from asyncserve.sampling_params import SamplingParams


class TokenizerLike(Protocol):
    eos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str: ...


class EngineClient(Protocol):
    config: EngineConfig
    tokenizer: Any  # TokenizerLike; Any so engines with richer tokenizers type-check
    model_path: str
    max_model_len: int
    generation_config: dict[str, Any]

    @property
    def is_running(self) -> bool: ...

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def kv_cache_usage(self) -> float: ...

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def num_total_blocks(self) -> int: ...

    async def start(self) -> None: ...

    async def shutdown(self, timeout: float | None = None) -> None: ...

    async def wait_until_dead(self) -> str:
        """Return the reason once the engine has failed for good (never on a normal stop)."""
        ...

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None: ...

    def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
        trace_headers: Mapping[str, str] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Validate and register an adapter (ValueError naming the problem)."""
        ...

    def remove_lora(self, lora_int_id: int) -> bool: ...
