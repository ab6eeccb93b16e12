"""LoRA adapters on the server: --lora-modules at start, adapters in /v1/models with their
parent, and vLLM's runtime /v1/load_lora_adapter and /v1/unload_lora_adapter (only when
runtime updating is allowed: they change what the server runs)."""

from __future__ import annotations

import asyncio
import itertools

import msgspec
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from asyncserve.http.errors import APIError
from asyncserve.http.protocol import ModelCard
from asyncserve.http.serving import ServerState
from asyncserve.lora.request import LoRARequest


class LoadLoRAAdapterRequest(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_int_id: int | None = None


class LoRARegistry:
    """Names to adapters; ids are handed out once, so a reloaded name never reuses cached
    weights or prefix-cache entries of the adapter it replaced."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self._ids = itertools.count(1)
        # Serialises loads and unloads: a name is checked and registered as one step.
        self._lock = asyncio.Lock()

    def register_startup(self, modules: tuple[tuple[str, str], ...]) -> None:
        """--lora-modules: validated before the server listens (a bad one stops startup)."""
        for name, path in modules:
            if name in self.state.loras or name in self.state.model_names:
                raise ValueError(f"--lora-modules: the name {name!r} is used twice")
            request = LoRARequest(name, next(self._ids), path)
            self.state.engine.add_lora(request)
            self.state.loras[name] = request

    async def load(self, body: LoadLoRAAdapterRequest) -> str:
        state = self.state
        if not body.lora_name:
            raise APIError("lora_name must not be empty", 400, "lora_name")
        if not body.lora_path:
            raise APIError("lora_path must not be empty", 400, "lora_path")
        if not state.engine.config.lora.enable_lora:
            raise APIError("LoRA is not enabled: start the server with --enable-lora", 400)
        async with self._lock:
            old = state.loras.get(body.lora_name)
            if body.lora_name in state.model_names or (old is not None and not body.load_inplace):
                raise APIError(
                    f"The lora adapter '{body.lora_name}' has already been loaded.",
                    400,
                    "lora_name",
                )
            request = LoRARequest(body.lora_name, next(self._ids), body.lora_path)
            try:
                # Reads the adapter from disk: off the event loop.
                await asyncio.to_thread(state.engine.add_lora, request)
            except ValueError as exc:
                raise APIError(str(exc), 400, "lora_path") from None
            state.loras[body.lora_name] = request
            if old is not None:
                await asyncio.to_thread(state.engine.remove_lora, old.lora_int_id)
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    async def unload(self, body: UnloadLoRAAdapterRequest) -> str:
        async with self._lock:
            request = self.state.loras.get(body.lora_name)
            if request is None or (
                body.lora_int_id is not None and body.lora_int_id != request.lora_int_id
            ):
                raise APIError(
                    f"The lora adapter '{body.lora_name}' cannot be found.", 404, "lora_name"
                )
            del self.state.loras[body.lora_name]
            # Data parallel: waits for every replica's answer, off the event loop.
            await asyncio.to_thread(self.state.engine.remove_lora, request.lora_int_id)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."


def lora_cards(state: ServerState) -> list[ModelCard]:
    """One /v1/models card per adapter, its parent the base model's first name."""
    return [
        ModelCard(
            id=name,
            object="model",
            created=state.created,
            owned_by="asyncserve",
            root=request.lora_path,
            max_model_len=state.engine.max_model_len,
            parent=state.model_names[0],
        )
        for name, request in state.loras.items()
    ]


def routes(state: ServerState, registry: LoRARegistry) -> list[Route]:
    """The runtime endpoints, when allowed; none otherwise (404, as in vLLM)."""
    if not state.config.allow_runtime_lora_updating:
        return []

    async def load(request: Request) -> Response:
        body = await state.read_json(request, LoadLoRAAdapterRequest)
        return PlainTextResponse(await registry.load(body))

    async def unload(request: Request) -> Response:
        body = await state.read_json(request, UnloadLoRAAdapterRequest)
        return PlainTextResponse(await registry.unload(body))

    return [
        Route("/v1/load_lora_adapter", load, methods=["POST"]),
        Route("/v1/unload_lora_adapter", unload, methods=["POST"]),
    ]
