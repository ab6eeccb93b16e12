"""asyncserve: an LLM inference and serving engine."""

from asyncserve.beam_search import BeamSearchOutput, BeamSearchParams
from asyncserve.lora.request import LoRARequest
from asyncserve.outputs import CompletionOutput, Logprob, RequestOutput
from asyncserve.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "AsyncEngine",
    "BeamSearchOutput",
    "BeamSearchParams",
    "CompletionOutput",
    "Logprob",
    "LoRARequest",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # Lazy, so `import asyncserve` stays cheap (no torch) for the CLI's --help.
    if name == "LLM":
        from asyncserve.llm import LLM

        return LLM
    if name == "AsyncEngine":
        from asyncserve.engine.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(name)
