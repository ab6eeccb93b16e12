"""OpenAI's tool shapes: `tools` and `tool_choice` in a chat request, `tool_calls` in the
response message and in streamed deltas."""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class FunctionDefinition(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(msgspec.Struct, kw_only=True, omit_defaults=True):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class DeltaFunctionCall(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, omit_defaults=True):
    """A call's first delta has id, type and name; later ones add argument text."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None
