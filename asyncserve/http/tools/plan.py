"""A chat request's tool handling, decided before it runs: which mode (none, auto, required,
a named function), the parser that reads the output, and for forced calls the JSON schema
the grammar engine holds the output to. Bad combinations are 400s naming the field, worded
as vLLM's."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from asyncserve.core.grammar_limits import check_recursion
from asyncserve.http.errors import APIError
from asyncserve.http.tools.forced import (
    NamedToolParser,
    RequiredToolParser,
    parameters_schema,
    required_schema,
)
from asyncserve.http.tools.parsers import TOOL_PARSERS, ParseResult, ToolParser
from asyncserve.http.tools.protocol import (
    ChatTool,
    FunctionCall,
    NamedToolChoice,
    ToolCall,
    ToolChoice,
)
from asyncserve.sampling_params import SamplingParams, StructuredOutputsParams

Mode = Literal["none", "auto", "required", "named"]


@dataclass
class ToolPlan:
    mode: Mode
    tools: list[dict[str, Any]]  # as the chat template and parsers see them
    parser_name: str | None = None
    function: str | None = None  # the named function
    parallel: bool = True  # parallel_tool_calls: more than one call allowed

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")

    def new_parser(self) -> ToolParser | None:
        """A parser for one choice's output; None when tool calls are not parsed."""
        if self.mode == "auto":
            assert self.parser_name is not None
            return TOOL_PARSERS[self.parser_name](self.tools)
        if self.mode == "required":
            return RequiredToolParser(self.tools)
        if self.mode == "named":
            assert self.function is not None
            return NamedToolParser(self.tools, self.function)
        return None

    def apply(self, params: SamplingParams) -> None:
        """Forced calls: the output held to the tools' schema; parsers whose markers are
        special tokens: those tokens kept in the text."""
        if self.mode == "required":
            schema = required_schema(self.tools, self.parallel)
            params.structured_outputs = StructuredOutputsParams(json=schema)
        elif self.mode == "named":
            function = next(
                t["function"] for t in self.tools if t["function"]["name"] == self.function
            )
            params.structured_outputs = StructuredOutputsParams(json=parameters_schema(function))
        parser = self.new_parser()
        if self.mode == "auto" and parser is not None and parser.keeps_special_tokens:
            params.skip_special_tokens = False

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """vLLM's: "tool_calls" when auto or required calls came out; a named call keeps
        the engine's reason (as OpenAI's API does), and so does an output cut short by
        max_tokens ("length"): its last call may be incomplete."""
        if reason not in (None, "length") and called and self.mode in ("auto", "required"):
            return "tool_calls"
        return reason


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def tool_calls(result: ParseResult) -> list[ToolCall]:
    return [ToolCall(new_call_id(), FunctionCall(c.name, c.arguments)) for c in result.calls]


def plan_tools(
    tools: list[ChatTool] | None,
    tool_choice: ToolChoice | None,
    parallel_tool_calls: bool | None,
    parser_name: str | None,
    has_constraint: bool,
) -> ToolPlan:
    """The request's ToolPlan; `parser_name`: the server's --tool-call-parser when
    --enable-auto-tool-choice is on; `has_constraint`: the request has its own
    structured_outputs / response_format."""
    as_dicts = [msgspec.to_builtins(t) for t in tools or []]
    for i, tool in enumerate(tools or []):
        if not tool.function.name:
            where = f"tools[{i}].function.name"
            raise APIError("a tool's function name must not be empty", 400, where)
    # The field to blame for a missing parser: tool_choice when the client chose "auto".
    auto_param = "tool_choice" if tool_choice is not None else "tools"
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return ToolPlan("none", as_dicts)
    if not tools:
        raise APIError("When using `tool_choice`, `tools` must be set.", 400, "tool_choice")
    if tool_choice == "auto":
        if parser_name is None:
            raise APIError(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set",
                400,
                auto_param,
            )
        return ToolPlan("auto", as_dicts, parser_name=parser_name)
    if tool_choice == "required":
        _check_unconstrained(has_constraint)
        _check_parameters(as_dicts, range(len(as_dicts)))
        return ToolPlan("required", as_dicts, parallel=parallel_tool_calls is not False)
    assert isinstance(tool_choice, NamedToolChoice)
    _check_unconstrained(has_constraint)
    name = tool_choice.function.name
    index = next((i for i, t in enumerate(as_dicts) if t["function"]["name"] == name), None)
    if index is None:
        raise APIError(
            f"tool_choice names the function {name!r}, which is not in tools",
            400,
            "tool_choice.function.name",
        )
    _check_parameters(as_dicts, [index])
    return ToolPlan("named", as_dicts, function=name)


def _check_parameters(tools: list[dict[str, Any]], indices: Iterable[int]) -> None:
    """A 400 for a forced tool whose parameters no finite value matches (its recursion
    never ends), with JSON pointers into that tool's own schema. The grammar engine checks
    the whole output schema again, with everything else, before the request is queued."""
    for i in indices:
        schema = parameters_schema(tools[i]["function"])
        try:
            check_recursion(schema, f"tools[{i}].function.parameters")
        except ValueError as exc:
            raise APIError(str(exc), 400, "tools") from None


def _check_unconstrained(has_constraint: bool) -> None:
    if has_constraint:
        raise APIError(
            "tool_choice 'required' or a named function cannot be combined with "
            "structured_outputs, response_format or guided_* fields",
            400,
            "tool_choice",
        )
