"""Tool-call parsers by vLLM's --tool-call-parser names."""

from __future__ import annotations

from asyncserve.http.tools.parsers.base import ParsedCall, ParseResult, ToolParser
from asyncserve.http.tools.parsers.hermes import HermesToolParser
from asyncserve.http.tools.parsers.llama3_json import Llama3JsonToolParser
from asyncserve.http.tools.parsers.mistral import MistralToolParser
from asyncserve.http.tools.parsers.pythonic import PythonicToolParser
from asyncserve.http.tools.parsers.qwen3_xml import Qwen3XmlToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "llama4_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
    "llama4_pythonic": PythonicToolParser,
    "qwen3_xml": Qwen3XmlToolParser,
    "qwen3_coder": Qwen3XmlToolParser,
}

__all__ = ["TOOL_PARSERS", "ParseResult", "ParsedCall", "ToolParser"]
