"""`python -m asyncserve serve|generate|bench`, flags named as vLLM names them.

`build_parser()` returns the whole parser; other modules add subcommands to it the way
asyncserve.bench.cli adds `bench` (a subparser whose defaults set `handler`).
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import sys
from typing import TYPE_CHECKING, Any

from asyncserve.cli_engine import _positive_int as _positive_int
from asyncserve.cli_engine import add_engine_arguments as add_engine_arguments
from asyncserve.cli_engine import engine_config_from_args as engine_config_from_args

# Re-exported: asyncserve.cli is where the serve flags have always been imported from.
from asyncserve.cli_server import DEFAULT_SERVED_NAME as DEFAULT_SERVED_NAME
from asyncserve.cli_server import (
    add_server_arguments,
    expand_config_file,
    server_config_from_args,
)
from asyncserve.cli_server import parse_bytes as parse_bytes
from asyncserve.cli_server import served_names as served_names
from asyncserve.config import (
    EngineConfig,
    Environment,
)
from asyncserve.gc_heap import collection_paused

if TYPE_CHECKING:
    from asyncserve.metrics import EngineMetrics


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s"
    )


def _import_serve_modules(data_parallel: bool) -> None:
    """The server's and the engine's modules (torch among them), imported up front so that
    they load with garbage collection paused (see gc_heap.py)."""
    import asyncserve.http.server  # noqa: F401

    if data_parallel:
        import asyncserve.engine.dp_client  # noqa: F401
    else:
        import asyncserve.engine.async_engine  # noqa: F401


def run_serve(args: argparse.Namespace) -> int:
    env = Environment.read()
    with collection_paused():
        try:
            server_config = server_config_from_args(args, env)
            engine_config = engine_config_from_args(args, env)
        except ValueError as exc:
            print(f"asyncserve serve: error: {exc}", file=sys.stderr)
            return 2
        _import_serve_modules(engine_config.parallel.data_parallel_size > 1)
    _configure_logging(server_config.log_level)
    from asyncserve.http.listener import bound_socket

    try:
        # Before the model loads: a port in use fails in a second, not after the load.
        sock = bound_socket(server_config.host, server_config.port)
    except OSError as exc:
        in_use = exc.errno == errno.EADDRINUSE
        print(
            f"asyncserve serve: error: cannot bind {server_config.host}:{server_config.port}: "
            f"{exc.strerror or exc}{' (is another server using it?)' if in_use else ''}",
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
    with collection_paused():
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


# Commands that never run the proxy or the benchmarks: for them build_parser leaves those
# subcommands out, and their modules unimported (start-up time; tests/test_cli_imports.py).
_ENGINE_COMMANDS = ("serve", "generate")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; given the `command` about to run (serve or generate), one without
    the proxy and bench subcommands."""
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
    if command in _ENGINE_COMMANDS:
        return parser
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
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv[0] if argv else None)
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
