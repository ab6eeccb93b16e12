"""The engine's command-line flags (vLLM's names), shared by serve, generate and bench, and
the EngineConfig they give."""

from __future__ import annotations

import argparse
import json
from typing import Any

from asyncserve.cli_server import parse_bytes
from asyncserve.config import DEFAULT_DECODE_LATENCY_TARGET_MS, EngineConfig, Environment


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:  # argparse would name this function in its message
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model and engine")
    group.add_argument(
        "--model",
        default=None,
        help="HF directory, .gguf file, or a config directory with --load-format dummy "
        "(default: $ASYNCSERVE_MODEL, else the installed SmolLM2-135M-Instruct GGUF)",
    )
    group.add_argument("--tokenizer", default=None, help="tokenizer path (default: the model's)")
    group.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float", "bfloat16", "float16", "half"],
        help="weight and activation dtype; auto: the config's dtype on GPU, float32 on CPU",
    )
    group.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "dummy"],
        help="auto: real weights; dummy: random weights from config.json (benchmarks)",
    )
    group.add_argument(
        "--max-model-len",
        type=_positive_int,
        default=None,
        help="longest prompt + output in tokens (default: the model's context length)",
    )
    group.add_argument(
        "--seed", type=int, default=0, help="random seed (dummy weights, unseeded sampling)"
    )
    group.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="where the model runs; auto: cuda when available",
    )
    group.add_argument(
        "--quantization",
        "-q",
        default=None,
        help="weight quantization: fp8 quantizes an unquantized checkpoint at load; gguf keeps "
        "a .gguf file's Q8_0 / Q4_K / Q4_1 weights quantized; "
        "default: the checkpoint's quantization_config (fp8, compressed-tensors)",
    )
    group.add_argument(
        "--block-size", type=_positive_int, default=16, help="tokens per KV cache block"
    )
    group.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="fraction of GPU memory for weights, activations and the KV pool",
    )
    group.add_argument(
        "--kv-cache-memory",
        type=parse_bytes,
        default=None,
        help="KV pool size in bytes (e.g. 512M, 2GiB); on CPU the pool's size, on GPU it "
        "overrides --gpu-memory-utilization (CPU default: 1 GiB)",
    )
    group.add_argument(
        "--num-gpu-blocks-override", type=_positive_int, default=None, help="KV blocks, exactly"
    )
    group.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse KV blocks of identical prompt prefixes across requests",
    )
    group.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8", "fp8_e4m3"],
        help="KV cache dtype; fp8: e4m3 with a per-layer scale (half the bytes of bf16)",
    )
    group.add_argument(
        "--max-num-seqs", type=_positive_int, default=256, help="most sequences in one step"
    )
    group.add_argument(
        "--max-num-batched-tokens",
        type=_positive_int,
        default=2048,
        help="token budget of one step; long prompts are prefilled in chunks of it",
    )
    group.add_argument(
        "--decode-latency-target-ms",
        type=_non_negative_float,
        default=DEFAULT_DECODE_LATENCY_TARGET_MS,
        help="while streams decode, cap each step's prefill tokens so the step is expected "
        "to take at most this long (learned from measured step times; never below one "
        "block; --max-num-batched-tokens stays the ceiling); 0: no cap",
    )
    group.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=["fcfs", "priority"],
        help="fcfs: arrival order; priority: lower `priority` values first, then arrival",
    )
    group.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="plan each step while the one before runs, so the device never waits for "
        "the host (with grammars or penalties only sampling waits for the last tokens); "
        "default: on with CUDA, off on CPU (where a step's launch is its whole forward pass)",
    )
    group.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=_positive_int,
        default=1,
        help="devices (one worker process each) the model is split over",
    )
    group.add_argument(
        "--enable-lora", action="store_true", help="serve LoRA adapters (PEFT format)"
    )
    group.add_argument(
        "--max-loras", type=_positive_int, default=1, help="most adapters one step may mix"
    )
    group.add_argument(
        "--max-lora-rank", type=_positive_int, default=16, help="largest adapter rank accepted"
    )
    group.add_argument(
        "--max-cpu-loras",
        type=_positive_int,
        default=None,
        help="adapters kept in host memory (default: --max-loras)",
    )
    group.add_argument(
        "--data-parallel-size",
        "-dp",
        type=_positive_int,
        default=1,
        help="engine replicas, each in its own process on its own --tensor-parallel-size "
        "devices, behind the one server (requests go to the least loaded one)",
    )
    group.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="MoE models: place whole experts on the tensor-parallel ranks instead of "
        "slicing every expert",
    )
    group.add_argument(
        "--disable-custom-all-reduce",
        action="store_true",
        help="tensor parallelism on one host's GPUs: all-reduce through NCCL only (by default "
        "small all-reduces use a one-shot kernel over symmetric memory when the GPUs have peer "
        "access)",
    )
    group.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=_positive_int,
        default=1,
        help="stages the model's layers are split into, tensor-parallel-size devices each "
        "(with --distributed-executor-backend ray)",
    )
    group.add_argument(
        "--distributed-executor-backend",
        choices=["mp", "ray", "uni"],
        default=None,
        help="where the tensor-parallel workers run: mp (processes of this host, the default "
        "with several workers), ray (actors of a Ray cluster, across nodes), uni (this process)",
    )
    group.add_argument(
        "--ray-placement-strategy",
        choices=["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"],
        default="STRICT_PACK",
        help="with --distributed-executor-backend ray: STRICT_PACK keeps every worker on one "
        "node; SPREAD places them across nodes",
    )
    group.add_argument(
        "--enforce-eager", action="store_true", help="no CUDA graphs (GPU only; always on CPU)"
    )
    group.add_argument(
        "--max-cudagraph-capture-size",
        type=_positive_int,
        default=512,
        help="decode steps of up to this many requests replay CUDA graphs captured at start "
        "(default 512; capped by --max-num-seqs); larger steps run eager",
    )
    group.add_argument(
        "--runner",
        default="auto",
        choices=["auto", "generate", "pooling"],
        help="pooling: embeddings and scores (/v1/embeddings, /pooling, /score, /rerank); "
        "auto: pooling for encoders, decoder bodies and sentence-transformers checkpoints",
    )
    group.add_argument(
        "--kv-transfer-config",
        type=_json_object,
        default=None,
        help='disaggregated prefill, as JSON: {"kv_connector": "TCPConnector", "kv_role": '
        '"kv_producer" | "kv_consumer" | "kv_both", "kv_rank": r, "kv_parallel_size": 2}',
    )
    group.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        help="export one OpenTelemetry span per request to this OTLP collector "
        "(grpc by default; OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf for HTTP)",
    )
    group.add_argument(
        "--collect-detailed-traces",
        default=None,
        choices=["model", "worker", "all"],
        help="also time the engine steps each traced request was in",
    )
    group.add_argument(
        "--speculative-config",
        default=None,
        help='speculative decoding as JSON, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\'',
    )
    group.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=None,
        metavar="HOST",
        help="hosts that http(s) image URLs may name (exact host names, space separated); "
        "without it only data: URLs are read. Private and loopback addresses are refused",
    )
    group.add_argument(
        "--limit-mm-per-prompt",
        type=_json_object,
        default=None,
        help="most multimodal items in one prompt, as JSON, e.g. '{\"image\": 2}' "
        "(default: 4 images)",
    )
    group.add_argument(
        "--stream-interval",
        type=_positive_int,
        default=1,
        help="tokens per streamed chunk: larger values send fewer, bigger SSE events",
    )


def engine_config_from_args(args: argparse.Namespace, env: Environment) -> EngineConfig:
    return EngineConfig.from_engine_args(
        args.model or env.default_model,
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        load_format=args.load_format,
        max_model_len=args.max_model_len,
        seed=args.seed,
        device=args.device,
        runner=args.runner,
        quantization=args.quantization,
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory=args.kv_cache_memory,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        scheduling_policy=args.scheduling_policy,
        async_scheduling=args.async_scheduling,
        decode_latency_target_ms=args.decode_latency_target_ms,
        enforce_eager=args.enforce_eager,
        max_cudagraph_capture_size=args.max_cudagraph_capture_size,
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=getattr(args, "data_parallel_size", 1),
        enable_expert_parallel=args.enable_expert_parallel,
        disable_custom_all_reduce=args.disable_custom_all_reduce,
        pipeline_parallel_size=args.pipeline_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
        ray_placement_strategy=args.ray_placement_strategy,
        stream_interval=args.stream_interval,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        kv_transfer_config=args.kv_transfer_config,
        collect_detailed_traces=args.collect_detailed_traces,
        served_model_name=(getattr(args, "served_model_name", None) or [None])[0],
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        speculative_config=args.speculative_config,
        allowed_media_domains=args.allowed_media_domains,
        limit_mm_per_prompt=args.limit_mm_per_prompt,
    )
