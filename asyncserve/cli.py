"""`python -m asyncserve serve|generate|bench`, flags named as vLLM names them.

`build_parser()` returns the whole parser; other modules add subcommands to it the way
asyncserve.bench.cli adds `bench` (a subparser whose defaults set `handler`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from typing import TYPE_CHECKING, Any

# Re-exported: asyncserve.cli is where the serve flags have always been imported from.
from asyncserve.cli_server import DEFAULT_SERVED_NAME as DEFAULT_SERVED_NAME
from asyncserve.cli_server import (
    add_server_arguments,
    expand_config_file,
    parse_bytes,
    server_config_from_args,
)
from asyncserve.cli_server import served_names as served_names
from asyncserve.config import (
    DEFAULT_DECODE_LATENCY_TARGET_MS,
    EngineConfig,
    Environment,
)

if TYPE_CHECKING:
    from asyncserve.metrics import EngineMetrics


def _positive_int(text: str) -> int:
    value = int(text)
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
    value = float(text)
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
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=getattr(args, "data_parallel_size", 1),
        enable_expert_parallel=args.enable_expert_parallel,
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
    )


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s"
    )


def run_serve(args: argparse.Namespace) -> int:
    env = Environment.read()
    try:
        server_config = server_config_from_args(args, env)
        engine_config = engine_config_from_args(args, env)
    except ValueError as exc:
        print(f"asyncserve serve: error: {exc}", file=sys.stderr)
        return 2
    _configure_logging(server_config.log_level)
    from asyncserve.http.listener import bound_socket

    try:
        # Before the model loads: a port in use fails in a second, not after the load.
        sock = bound_socket(server_config.host, server_config.port)
    except OSError as exc:
        print(
            f"asyncserve serve: error: cannot bind {server_config.host}:{server_config.port}: "
            f"{exc.strerror or exc} (is another server using it?)",
            file=sys.stderr,
        )
        return 1
    from asyncserve.http.engine_client import EngineClient
    from asyncserve.http.server import run_server
    from asyncserve.lora.request import LoRARequest
    from asyncserve.metrics import EngineMetrics, ServerMetrics

    metrics: ServerMetrics
    engine: EngineClient
    model_name = server_config.served_model_names[0]
    try:
        if engine_config.parallel.data_parallel_size > 1:
            from asyncserve.engine.dp_client import DataParallelClient
            from asyncserve.engine.dp_metrics import DataParallelMetrics

            engine = DataParallelClient(engine_config, model_name)
            metrics = DataParallelMetrics()
        else:
            engine_metrics = EngineMetrics(
                model_name, max_model_len=engine_config.model.max_model_len or 2**20
            )
            metrics = engine_metrics
            engine = build_engine(engine_config, engine_metrics)
        if server_config.lora_modules and not hasattr(engine, "add_lora"):
            raise ValueError(
                "--lora-modules: adapters are served by a generating model (not a pooling one)"
            )
        # A bad --lora-modules adapter stops the start, before the server listens.
        for i, (name, path) in enumerate(server_config.lora_modules):
            engine.add_lora(LoRARequest(name, 1 + i, path))
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        sock.close()
        print(f"asyncserve serve: error: {exc}", file=sys.stderr)
        return 2
    try:
        return run_server(engine, server_config, metrics, sock)
    finally:
        # The workers (tensor parallelism) end here rather than at interpreter exit, so that
        # their shared memory is freed by its owner. (Replicas and pooling engines have none.)
        executor = getattr(engine, "executor", None)
        if executor is not None:
            executor.shutdown()


def build_engine(config: EngineConfig, metrics: EngineMetrics | None) -> Any:
    """The engine the checkpoint needs: a pooling engine or a generating one."""
    from pathlib import Path

    from asyncserve.engine.async_engine import AsyncEngine
    from asyncserve.pooling.config import resolve_runner
    from asyncserve.pooling.engine import PoolingEngine

    model = Path(config.model.model) if config.model.model else None
    if (
        resolve_runner(config.model.runner, model if model and model.is_dir() else None)
        == "pooling"
    ):
        return PoolingEngine.from_config(config, metrics=metrics)
    return AsyncEngine.from_config(config, metrics=metrics)


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt text")
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=_positive_int, default=128, help="tokens to generate")
    group.add_argument(
        "--temperature", type=float, default=None, help="default: the model's, else 1.0"
    )
    group.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass")
    group.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest")
    group.add_argument("--min-p", type=float, default=None, help="drop tokens below min_p x max")
    group.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens")
    group.add_argument(
        "--chat", action="store_true", help="send the prompt as a user message, chat-templated"
    )


def sampling_params_from_args(args: argparse.Namespace, generation_config: dict[str, Any]) -> Any:
    from asyncserve.sampling_params import (
        MODEL_SAMPLING_DEFAULTS,
        RequestOutputKind,
        SamplingParams,
    )

    fields: dict[str, Any] = {}
    for key in MODEL_SAMPLING_DEFAULTS:
        value = getattr(args, key, None)
        if value is None:
            value = generation_config.get(key)
        if value is not None:
            fields[key] = value
    return SamplingParams(
        max_tokens=args.max_tokens,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        seed=args.seed,
        output_kind=RequestOutputKind.DELTA,
        **fields,
    )


async def _generate(engine: Any, args: argparse.Namespace) -> int:
    await engine.start()
    try:
        tokenizer = engine.tokenizer
        if args.chat:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": args.prompt}], add_generation_prompt=True
            )
            prompt_ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            prompt_ids = tokenizer.encode(args.prompt, add_special_tokens=True)
        params = sampling_params_from_args(args, engine.generation_config)
        engine.validate_request(prompt_ids, params)
        async for out in engine.generate(prompt_ids, params, "generate-0"):
            for completion in out.outputs:
                sys.stdout.write(completion.text)
            sys.stdout.flush()
            if out.error is not None:
                print(f"\nasyncserve generate: error: {out.error}", file=sys.stderr)
                return 1
        sys.stdout.write("\n")
        return 0
    finally:
        await engine.close()


def run_generate(args: argparse.Namespace) -> int:
    env = Environment.read()
    _configure_logging("warning" if env.log_level.upper() == "INFO" else env.log_level)
    from asyncserve.engine.async_engine import AsyncEngine

    try:
        config = engine_config_from_args(args, env)
        if config.parallel.data_parallel_size > 1:
            raise ValueError("--data-parallel-size is for serve; generate runs one engine")
        engine = AsyncEngine.from_config(config)
        return asyncio.run(_generate(engine, args))
    except ValueError as exc:
        print(f"asyncserve generate: error: {exc}", file=sys.stderr)
        return 2


class _DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default unless its help already says it (or it has none)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncserve",
        description="An LLM inference and serving engine with an OpenAI-compatible server.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    formatter = _DefaultsHelpFormatter
    serve = commands.add_parser(
        "serve",
        help="serve the OpenAI-compatible API over HTTP",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /generate, "
        "/health, /metrics, /version and /openapi.json.",
        formatter_class=formatter,
    )
    serve.add_argument("model_tag", nargs="?", default=None, help="the model (same as --model)")
    serve.add_argument(
        "--config",
        default=None,
        help="a YAML file of flags (keys: flag names without the dashes); flags on the "
        "command line override it",
    )
    add_engine_arguments(serve)
    add_server_arguments(serve)
    parser.set_defaults(serve_parser=serve)
    serve.set_defaults(handler=run_serve)
    generate = commands.add_parser(
        "generate",
        help="complete one prompt and stream it to the terminal",
        description="Load the model, complete one prompt, print tokens as they come.",
        formatter_class=formatter,
    )
    add_generate_arguments(generate)
    add_engine_arguments(generate)
    generate.set_defaults(handler=run_generate)
    from asyncserve.disagg.proxy import add_proxy_arguments, run_proxy

    proxy = commands.add_parser(
        "proxy",
        help="route requests to prefill then decode instances (disaggregated prefill)",
        description="An OpenAI-compatible router: each request is prefilled on a --prefill "
        "instance (kv_producer), then decoded on a --decode instance (kv_consumer).",
    )
    add_proxy_arguments(proxy)
    proxy.set_defaults(handler=run_proxy)
    try:
        from asyncserve.bench.cli import add_parser as add_bench_parser
    except ImportError:
        pass
    else:
        add_bench_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "serve":
        argv = expand_config_file(argv, parser.get_default("serve_parser"))
    args = parser.parse_args(argv)
    if getattr(args, "model_tag", None) is not None:
        if args.model is not None and args.model != args.model_tag:
            parser.error("give the model once: as the positional argument or as --model")
        args.model = args.model_tag
    result = args.handler(args)
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
