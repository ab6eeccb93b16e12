"""`serve`'s server flags, named and read as vLLM's: --root-path, CORS, usage and logprobs
options, --chat-template, --generation-config, and a YAML --config taking any flag."""

from __future__ import annotations

import argparse
import codecs
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncserve.config import Environment, ServerConfig
from asyncserve.http.tools.parsers import TOOL_PARSERS

TOOL_PARSER_NAMES = tuple(TOOL_PARSERS)

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?B?)\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """`1073741824`, `512M`, `2GiB`, `1.5G` -> bytes (K/M/G/T are powers of 1024)."""
    match = _SIZE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 536870912, 512M, 2GiB)")
    number, unit = float(match.group(1)), match.group(2).upper()
    value = int(number * 1024 ** "_KMGT".index(unit or "_"))
    if value < 1:
        raise argparse.ArgumentTypeError(f"byte size must be positive, got {text!r}")
    return value


def _json_list(text: str) -> list[str]:
    """vLLM takes the CORS lists as JSON: '["https://a.example", "https://b.example"]'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not a JSON list: {text!r} ({exc})") from exc
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"not a JSON list of strings: {text!r}")
    return value


def _positive_or_none(text: str) -> float | None:
    """A timeout in seconds; 0 turns it off."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value or None


def load_chat_template(value: str | None) -> str | None:
    """--chat-template as vLLM reads it: a file's contents, else the template itself when it
    looks like Jinja (escapes such as \\n decoded); anything else is a missing file."""
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        text = path.read_text()
    elif any(c in value for c in "{}\n"):
        text = codecs.decode(value, "unicode_escape")
    else:
        raise ValueError(f"--chat-template: {value!r} is neither a readable file nor a template")
    from asyncserve.chat_template import _compile

    try:
        _compile(text)
    except Exception as exc:  # a syntax error fails the start, not every chat request
        raise ValueError(f"--chat-template: not a valid Jinja template: {exc}") from exc
    return text


def check_generation_config(value: str) -> str:
    if value in ("auto", "vllm") or (Path(value) / "generation_config.json").is_file():
        return value
    raise ValueError(
        f"--generation-config: {value!r} is not 'auto', 'vllm' or a folder holding a "
        "generation_config.json"
    )


def check_readable(flag: str, value: str | None) -> None:
    """A file flag's path, checked before the model loads (the TLS files are read only
    when the server starts listening, after it)."""
    if value is not None:
        try:
            with open(value, "rb"):
                pass
        except OSError as exc:
            raise ValueError(f"{flag}: cannot read {value!r}: {exc.strerror or exc}") from exc


def parse_lora_module(text: str) -> tuple[str, str]:
    """One --lora-modules entry: name=path, or vLLM's JSON {"name": ..., "path": ...}."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"invalid JSON {text!r}: {exc}") from None
        name, path = (
            (value.get("name"), value.get("path")) if isinstance(value, dict) else (None, None)
        )
        if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
            raise argparse.ArgumentTypeError(f"{text!r} needs string 'name' and 'path' fields")
        return name, path
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r} is not name=path")
    return name, path


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on")
    group.add_argument("--port", type=int, default=8000, help="port to listen on")
    group.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="names the model answers to in `model` (several aliases allowed; the first is "
        "reported); default: the model's name",
    )
    group.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer <key>` on every route but /health and /metrics "
        "(default: $ASYNCSERVE_API_KEY)",
    )
    group.add_argument(
        "--lora-modules",
        nargs="+",
        type=parse_lora_module,
        default=[],
        help="LoRA adapters served by name (name=path or JSON), with --enable-lora; "
        "$ASYNCSERVE_ALLOW_RUNTIME_LORA_UPDATING=1 adds /v1/load_lora_adapter and "
        "/v1/unload_lora_adapter",
    )
    group.add_argument("--ssl-keyfile", default=None, help="TLS private key (PEM)")
    group.add_argument("--ssl-certfile", default=None, help="TLS certificate chain (PEM)")
    group.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds running requests get to finish after SIGTERM before they are aborted",
    )
    group.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="answer 503 with Retry-After while this many requests wait to be scheduled",
    )
    group.add_argument(
        "--max-request-body-bytes",
        type=parse_bytes,
        default=None,
        help="larger request bodies get 413 (default: max_model_len x 48 bytes, at least 1M)",
    )
    group.add_argument(
        "--timeout-request-header",
        type=_positive_or_none,
        default=10.0,
        help="seconds a connection gets to send a request's headers, then 408 (0: none)",
    )
    group.add_argument(
        "--timeout-request-body",
        type=_positive_or_none,
        default=60.0,
        help="seconds a request gets to send its whole body, then 408 (0: none)",
    )
    group.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=5.0,
        help="seconds an idle keep-alive connection stays open",
    )
    group.add_argument(
        "--limit-concurrency",
        type=int,
        default=None,
        help="most connections and requests at once; more get 503 (default: no limit)",
    )
    group.add_argument(
        "--enable-log-requests", action="store_true", help="log every request's prompt and params"
    )
    group.add_argument(
        "--max-log-len",
        type=int,
        default=None,
        help="prompt characters (or token ids) written per logged request (default: 512)",
    )
    group.add_argument(
        "--disable-uvicorn-access-log", action="store_true", help="no access log at all"
    )
    group.add_argument(
        "--disable-access-log-for-endpoints",
        default="",
        help="comma-separated paths left out of the access log, e.g. /health,/metrics",
    )
    group.add_argument(
        "--uvicorn-log-level",
        default=None,
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="server log level (default: $ASYNCSERVE_LOG_LEVEL, else info)",
    )
    group.add_argument(
        "--root-path",
        default=None,
        help="the path prefix a proxy serves this server under (e.g. /llm): /llm/v1/models "
        "and /v1/models both work",
    )
    group.add_argument(
        "--allowed-origins",
        type=_json_list,
        default=["*"],
        help="CORS origins, a JSON list (e.g. '[\"https://a.example\"]')",
    )
    group.add_argument(
        "--allowed-methods", type=_json_list, default=["*"], help="CORS methods, a JSON list"
    )
    group.add_argument(
        "--allowed-headers", type=_json_list, default=["*"], help="CORS headers, a JSON list"
    )
    group.add_argument("--allow-credentials", action="store_true", help="CORS credentials")
    group.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        help="send X-Request-Id on every response (the request's own, else a fresh one)",
    )
    group.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="usage on every streamed response (final and per chunk), whatever stream_options say",
    )
    group.add_argument(
        "--enable-per-request-metrics",
        action="store_true",
        help="timing `metrics` in single-sequence responses (streams: on the usage chunk)",
    )
    group.add_argument(
        "--enable-server-load-tracking",
        action="store_true",
        help="count in-flight generation requests for GET /load",
    )
    group.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help='tokens in logprobs as "token_id:<id>" unless a request says otherwise',
    )
    group.add_argument(
        "--max-logprobs",
        type=int,
        default=20,
        help="most logprobs / top_logprobs / prompt_logprobs a request may ask for; -1: "
        "the vocabulary size (what a request's -1 asks for)",
    )
    group.add_argument(
        "--chat-template",
        default=None,
        help="a chat template file, or the template itself (single-line Jinja), used "
        "instead of the tokenizer's",
    )
    group.add_argument(
        "--generation-config",
        default="auto",
        help="sampling defaults: auto (the model's generation_config.json), vllm (none), "
        "or a folder holding a generation_config.json",
    )
    group.add_argument(
        "--metrics-prefix",
        default="both",
        choices=["both", "vllm", "asyncserve"],
        help="names of the /metrics series: both (asyncserve:* and vLLM's vllm:*, so "
        "dashboards made for vLLM work unchanged), vllm or asyncserve",
    )
    group.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto": the model decides when to call tools (needs --tool-call-parser)',
    )
    group.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSER_NAMES),
        help="how tool calls are read from the model's output (for tool_choice auto)",
    )


def served_names(args: argparse.Namespace, env: Environment) -> tuple[str, ...]:
    """--served-model-name; else the --model string as given (as vLLM serves it) and, when
    shorter, its file or directory name as an alias; else the default model's name."""
    if args.served_model_name:
        return tuple(args.served_model_name)
    from asyncserve.http.app import default_model_name

    model = args.model or env.default_model
    if not model:
        return (DEFAULT_SERVED_NAME,)
    short = default_model_name(model.rstrip("/"))
    return (model,) if short == model else (model, short)


def server_config_from_args(args: argparse.Namespace, env: Environment) -> ServerConfig:
    endpoints = tuple(p.strip() for p in args.disable_access_log_for_endpoints.split(",") if p)
    config = ServerConfig(
        host=args.host,
        port=args.port,
        served_model_names=served_names(args, env),
        api_key=args.api_key or env.api_key,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        shutdown_timeout=args.shutdown_timeout,
        max_log_len=args.max_log_len,
        enable_log_requests=args.enable_log_requests,
        disable_access_log=args.disable_uvicorn_access_log,
        disable_access_log_for_endpoints=endpoints,
        max_waiting_requests=args.max_waiting_requests,
        max_request_body_bytes=args.max_request_body_bytes,
        timeout_request_header=args.timeout_request_header,
        timeout_request_body=args.timeout_request_body,
        timeout_keep_alive=args.timeout_keep_alive,
        limit_concurrency=args.limit_concurrency,
        log_level=(args.uvicorn_log_level or env.log_level).lower(),
        root_path=(args.root_path or "").rstrip("/"),
        allowed_origins=tuple(args.allowed_origins),
        allowed_methods=tuple(args.allowed_methods),
        allowed_headers=tuple(args.allowed_headers),
        allow_credentials=args.allow_credentials,
        enable_request_id_headers=args.enable_request_id_headers,
        enable_force_include_usage=args.enable_force_include_usage,
        enable_per_request_metrics=args.enable_per_request_metrics,
        enable_server_load_tracking=args.enable_server_load_tracking,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        max_logprobs=args.max_logprobs,
        chat_template=load_chat_template(args.chat_template),
        generation_config=check_generation_config(args.generation_config),
        lora_modules=tuple(args.lora_modules),
        allow_runtime_lora_updating=env.allow_runtime_lora_updating,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        metrics_prefix=args.metrics_prefix,
    )
    check_readable("--ssl-keyfile", config.ssl_keyfile)
    check_readable("--ssl-certfile", config.ssl_certfile)
    return config


def expand_config_file(argv: Sequence[str], parser: argparse.ArgumentParser) -> list[str]:
    """`serve --config f.yaml ...`: the file's keys (flag names without the dashes) as flags
    placed before the command line's own, so that those override them, as vLLM does."""
    argv = list(argv)
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            path, rest = argv[i + 1], argv[:i] + argv[i + 2 :]
            break
        if arg.startswith("--config="):
            path, rest = arg.split("=", 1)[1], argv[:i] + argv[i + 1 :]
            break
    else:
        return argv
    import yaml

    try:
        loaded = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        parser.error(f"--config {path}: {exc}")
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        parser.error(f"--config {path}: the file must hold a mapping of flag names to values")
    position = rest.index("serve") + 1 if "serve" in rest else 0
    flags = _config_flags(loaded, parser, path)
    return rest[:position] + flags + rest[position:]


def _config_flags(values: dict[str, Any], parser: argparse.ArgumentParser, path: str) -> list[str]:
    actions = parser._option_string_actions  # argparse's map of flag -> action
    flags: list[str] = []
    for key, value in values.items():
        flag = "--" + str(key).replace("_", "-")
        action = actions.get(flag)
        if action is None or flag == "--config":
            parser.error(f"--config {path}: unknown option {key!r}")
        if isinstance(value, bool):
            if value:
                flags.append(flag)
            elif isinstance(action, argparse.BooleanOptionalAction):
                flags.append("--no-" + flag[2:])
            continue
        if value is None:
            continue
        if action.type is _json_list or isinstance(value, dict):
            flags += [flag, json.dumps(value)]  # JSON-valued flags given as YAML mappings
        elif isinstance(value, list):
            flags += [flag, *(str(v) for v in value)]
        else:
            flags += [flag, str(value)]
    return flags
