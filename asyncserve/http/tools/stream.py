"""One streamed choice's tool calls: each parse of the output so far is compared with what
was sent, and the difference goes out as OpenAI's deltas (content, then per call a first
delta with id, type and name, then argument fragments)."""

from __future__ import annotations

from asyncserve.http.tools.json_scan import JSONScanError
from asyncserve.http.tools.parsers import ParseResult, ToolParser
from asyncserve.http.tools.plan import new_call_id
from asyncserve.http.tools.protocol import DeltaFunctionCall, DeltaToolCall


class ToolCallStream:
    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.content = ""  # content sent so far
        self.arguments: list[str] = []  # per call: argument text sent so far

    @property
    def called(self) -> bool:
        return bool(self.arguments)

    def feed(self, delta: str, final: bool) -> tuple[str, list[DeltaToolCall]]:
        """New content and tool-call deltas after `delta` (`final`: the output is done)."""
        self.text += delta
        if final:
            result = self.parser.extract(self.text)
            if self.arguments and not result.calls:
                # Calls already went out (the output was cut short mid-call): finish them
                # as far as the text goes; their text sent again as content would repeat it.
                try:
                    result = self.parser.parse(self.text, final=True)
                except (JSONScanError, ValueError, SyntaxError):
                    return "", []
        else:
            try:
                result = self.parser.parse(self.text, final=False)
            except (JSONScanError, ValueError, SyntaxError):
                return "", []  # malformed so far: the final parse decides
        return self._content(result), self._calls(result)

    def _content(self, result: ParseResult) -> str:
        if not result.content.startswith(self.content):
            return ""
        new = result.content[len(self.content) :]
        self.content = result.content
        return new

    def _calls(self, result: ParseResult) -> list[DeltaToolCall]:
        deltas: list[DeltaToolCall] = []
        for index, call in enumerate(result.calls):
            if index >= len(self.arguments):
                self.arguments.append("")
                deltas.append(
                    DeltaToolCall(
                        index=index,
                        id=new_call_id(),
                        type="function",
                        function=DeltaFunctionCall(name=call.name, arguments=""),
                    )
                )
            sent = self.arguments[index]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                self.arguments[index] = call.arguments
                fragment = call.arguments[len(sent) :]
                deltas.append(
                    DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=fragment))
                )
        return deltas
