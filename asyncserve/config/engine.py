"""EngineConfig: every engine section, built from vLLM's engine argument names."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncserve.config.environment import image_fetch_timeout_s
from asyncserve.config.features import KVTransferConfig, LoRAConfig, ObservabilityConfig
from asyncserve.config.multimodal import (
    DEFAULT_MEDIA_FETCH_TIMEOUT_S,
    MultiModalConfig,
    parse_allowed_media_domains,
    parse_limit_mm_per_prompt,
)
from asyncserve.config.sections import (
    DEFAULT_DECODE_LATENCY_TARGET_MS,
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from asyncserve.config.typecheck import check_fields, typed_arguments
from asyncserve.spec_decode.config import SpeculativeConfig


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
    multimodal: MultiModalConfig = field(default_factory=MultiModalConfig)
    # Step-loop behaviour.
    enable_cuda_graphs: bool = True
    # Decode steps of up to this many requests replay captured graphs; larger ones run eager.
    max_cudagraph_capture_size: int = 512
    stream_interval: int = 1

    def __post_init__(self) -> None:
        check_fields(self)
        size = self.max_cudagraph_capture_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"max_cudagraph_capture_size must be a positive integer, got {size!r}")
        spec = self.speculative
        parallel = self.parallel
        if (
            spec is not None
            and spec.model is not None
            and (parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1)
        ):
            what = "an EAGLE head" if spec.method in ("eagle", "eagle3") else "a draft model"
            raise ValueError(
                f"speculative_config: {what} needs tensor_parallel_size 1 and "
                "pipeline_parallel_size 1"
            )

    @classmethod
    @typed_arguments
    def from_engine_args(
        cls,
        model: str | os.PathLike[str] | None = None,
        *,
        tokenizer: str | os.PathLike[str] | None = None,
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
        max_cudagraph_capture_size: int = 512,
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
        disable_custom_all_reduce: bool = False,
        speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None,
        pipeline_parallel_size: int = 1,
        distributed_executor_backend: str | None = None,
        ray_placement_strategy: str = "STRICT_PACK",
        allowed_media_domains: str | Sequence[str] | None = None,
        limit_mm_per_prompt: str | dict[str, Any] | None = None,
    ) -> EngineConfig:
        """The engine's configuration from vLLM's engine argument names (LLM(...) and the
        serve flags both come here). An argument of the wrong type is a ValueError naming it."""
        return cls(
            model=ModelConfig(
                model=None if model is None else os.fspath(model),
                tokenizer=None if tokenizer is None else os.fspath(tokenizer),
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
                disable_custom_all_reduce=disable_custom_all_reduce,
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
            multimodal=MultiModalConfig(
                allowed_media_domains=parse_allowed_media_domains(allowed_media_domains),
                limit_mm_per_prompt=parse_limit_mm_per_prompt(limit_mm_per_prompt),
                media_fetch_timeout_s=image_fetch_timeout_s() or DEFAULT_MEDIA_FETCH_TIMEOUT_S,
            ),
            enable_cuda_graphs=not enforce_eager,
            max_cudagraph_capture_size=max_cudagraph_capture_size,
            stream_interval=stream_interval,
        ).checked()

    def checked(self) -> EngineConfig:
        """Options that do not go together: a one-line ValueError."""
        if self.kv_transfer is not None and self.parallel.data_parallel_size > 1:
            raise ValueError(
                "kv_transfer_config: disaggregated prefill runs one engine per instance "
                "(data_parallel_size 1); run one instance per replica instead"
            )
        if self.kv_transfer is not None and self.parallel.pipeline_parallel_size > 1:
            raise ValueError(
                "kv_transfer_config: disaggregated prefill runs with pipeline_parallel_size 1 "
                "(each pipeline stage holds only its own layers' KV blocks)"
            )
        return self
