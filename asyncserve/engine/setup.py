"""What an engine is built from: its device, the model (here, or shape only when workers
hold the weights) and the executor that runs it, its tracer and its EOS ids."""

from __future__ import annotations

from pathlib import Path

import torch

from asyncserve.config import EngineConfig
from asyncserve.executor.abstract import Executor
from asyncserve.executor.multiproc import MultiProcExecutor
from asyncserve.kernels.parallel_compiles import warm_up_compiler
from asyncserve.models.loader import LoadedModel, load_model
from asyncserve.models.parallel import TensorParallel
from asyncserve.models.pipeline import split_layers
from asyncserve.tracing import RequestTracer


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(
            f"device {name!r}: no CUDA device is available to this torch "
            f"({torch.__version__}); use device 'cpu' or 'auto'"
        )
    return torch.device(name)


def load_for_engine(
    config: EngineConfig, device: torch.device
) -> tuple[LoadedModel, Executor | None]:
    """The model and, when workers elsewhere run it (tensor or pipeline parallel), their
    executor; then the model here holds no weights (config, tokenizer and shape checks)."""
    size = config.parallel.tensor_parallel_size
    expert_parallel = config.parallel.enable_expert_parallel
    backend = config.parallel.distributed_executor_backend
    if backend == "uni" or (config.parallel.world_size == 1 and backend is None):
        tp = TensorParallel(expert_parallel=expert_parallel)
        warm_up_compiler(device)
        return load_model(config.model, device, tp), None
    tp = TensorParallel(0, size, expert_parallel)
    loaded = load_model(config.model, device, tp, weights=False)
    # More stages than layers is an error before any worker starts.
    split_layers(loaded.arch.num_hidden_layers, config.parallel.pipeline_parallel_size)
    if backend == "ray":
        from asyncserve.executor.ray_executor import RayExecutor

        return loaded, RayExecutor(config, device)
    return loaded, MultiProcExecutor(config, device)


def make_tracer(config: EngineConfig, model_path: str) -> RequestTracer | None:
    """The request tracer when --otlp-traces-endpoint is set; None costs nothing."""
    observability = config.observability
    if observability.otlp_traces_endpoint is None:
        return None
    path = Path(model_path.rstrip("/"))
    name = observability.served_model_name or (path.stem if path.suffix == ".gguf" else path.name)
    return RequestTracer(observability, name)


def eos_token_ids(loaded: LoadedModel, tokenizer_eos: int | None) -> list[int]:
    """The model's EOS ids, the generation config's first (it may list several), then the
    tokenizer's; the first is the one vLLM reports as no stop reason."""
    ids = list(loaded.generation_config.get("eos_token_id") or loaded.arch.eos_token_ids)
    if tokenizer_eos is not None and tokenizer_eos not in ids:
        ids.insert(0, tokenizer_eos)
    return ids
