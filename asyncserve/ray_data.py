"""Batch inference with Ray Data: one LLM per actor, batches of rows through `map_batches`.

vLLM's offline_inference/distributed.py pattern works as it is with asyncserve's LLM and
SamplingParams (a class that builds the LLM once in __init__ and generates per batch in
__call__). This module packs that pattern in the shape of ray.data.llm's processors, so a
job is three lines:

    config = LLMProcessorConfig(model_source=None, concurrency=2, batch_size=16)
    processor = build_llm_processor(config, sampling_params=SamplingParams(max_tokens=64))
    ds = processor(ray.data.read_text("prompts.txt"))

Each row's prompt is its "prompt_token_ids" column, else "prompt", else "text" (what
ray.data.read_text makes); a row may carry its own "sampling_params" (a dict of
SamplingParams fields). Output rows keep
their columns and gain "generated_text", "generated_tokens", "num_input_tokens", "num_generated_tokens" and
"time_taken_llm" (seconds of the batch's generate call), as ray.data.llm's do.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from asyncserve.llm import LLM
from asyncserve.sampling_params import SamplingParams

Row = dict[str, Any]
PROMPT_COLUMNS = ("prompt", "text")


@dataclass
class LLMProcessorConfig:
    """What each replica loads and how many there are (ray.data.llm's field names).

    `engine_kwargs` are LLM(...)'s arguments (vLLM's engine argument names); each replica
    holds tensor_parallel_size devices: GPUs, or CPUs where the cluster has no GPU."""

    model_source: str | None = None
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    concurrency: int = 1
    batch_size: int = 64

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if "model" in self.engine_kwargs:
            raise ValueError("engine_kwargs: name the model in model_source, not 'model'")


class LLMPredictor:
    """The callable class map_batches runs: an LLM per actor, one generate() per batch."""

    def __init__(
        self,
        model_source: str | None,
        engine_kwargs: dict[str, Any],
        sampling_params: SamplingParams | None,
    ) -> None:
        self.llm = LLM(model_source, **engine_kwargs)
        self.sampling_params = sampling_params or self.llm.get_default_sampling_params()

    def __call__(self, batch: dict[str, Any]) -> dict[str, list[Any]]:
        prompts: list[Any]
        if "prompt_token_ids" in batch:
            prompts = [{"prompt_token_ids": [int(t) for t in p]} for p in batch["prompt_token_ids"]]
        else:
            column = next((c for c in PROMPT_COLUMNS if c in batch), None)
            if column is None:
                raise ValueError(
                    "rows need a 'prompt', 'text' or 'prompt_token_ids' column, got "
                    f"{sorted(batch)} (map them with preprocess=...)"
                )
            prompts = [str(p) for p in batch[column]]
        params: SamplingParams | list[SamplingParams] = self.sampling_params
        if "sampling_params" in batch:
            params = [_row_params(self.sampling_params, row) for row in batch["sampling_params"]]
        start = time.perf_counter()
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        out: dict[str, list[Any]] = {name: list(values) for name, values in batch.items()}
        out["generated_text"] = []
        out["generated_tokens"] = []
        out["num_input_tokens"] = []
        out["num_generated_tokens"] = []
        out["time_taken_llm"] = [elapsed] * len(outputs)
        for output in outputs:
            if output.error is not None:
                raise ValueError(f"prompt {output.prompt!r}: {output.error}")
            first = output.outputs[0]
            out["generated_text"].append(first.text)
            out["generated_tokens"].append(list(first.token_ids))
            out["num_input_tokens"].append(len(output.prompt_token_ids))
            out["num_generated_tokens"].append(len(first.token_ids))
        return out


def _row_params(default: SamplingParams, row: dict[str, Any] | None) -> SamplingParams:
    if not row:
        return default
    fields = {k: v for k, v in row.items() if v is not None}
    return SamplingParams(**fields)


class Processor:
    """ds -> ds with generations: preprocess (per row), the LLM stage, postprocess."""

    def __init__(
        self,
        config: LLMProcessorConfig,
        sampling_params: SamplingParams | None,
        preprocess: Callable[[Row], Row] | None,
        postprocess: Callable[[Row], Row] | None,
    ) -> None:
        self.config = config
        self.sampling_params = sampling_params
        self.preprocess = preprocess
        self.postprocess = postprocess

    def resources(self) -> dict[str, float]:
        """Each replica's devices: tensor_parallel_size GPUs, or CPUs off GPU."""
        import ray

        config = self.config
        size = float(config.engine_kwargs.get("tensor_parallel_size", 1))
        device = config.engine_kwargs.get("device", "auto")
        if device == "cpu" or (device == "auto" and not ray.cluster_resources().get("GPU")):
            return {"num_cpus": size}
        return {"num_gpus": size}

    def __call__(self, ds: Any) -> Any:
        config = self.config
        if self.preprocess is not None:
            ds = ds.map(self.preprocess)
        ds = ds.map_batches(
            LLMPredictor,
            fn_constructor_kwargs={
                "model_source": config.model_source,
                "engine_kwargs": config.engine_kwargs,
                "sampling_params": self.sampling_params,
            },
            concurrency=config.concurrency,
            batch_size=config.batch_size,
            **self.resources(),
        )
        if self.postprocess is not None:
            ds = ds.map(self.postprocess)
        return ds


def build_llm_processor(
    config: LLMProcessorConfig,
    sampling_params: SamplingParams | None = None,
    preprocess: Callable[[Row], Row] | None = None,
    postprocess: Callable[[Row], Row] | None = None,
) -> Processor:
    """A processor that runs `config.concurrency` LLM replicas over a ray.data.Dataset.

    `sampling_params` applies to rows without their own (None: the model's defaults)."""
    return Processor(config, sampling_params, preprocess, postprocess)
