"""LoRA flags as vLLM names them: --enable-lora, --max-loras, --max-lora-rank,
--max-cpu-loras, --lora-modules (name=path or JSON); the runtime-updating switch comes from
ASYNCSERVE_ALLOW_RUNTIME_LORA_UPDATING."""

from __future__ import annotations

import argparse
from pathlib import Path

import httpx
import pytest

from asyncserve.cli import build_parser, engine_config_from_args, server_config_from_args
from asyncserve.cli_server import parse_lora_module
from asyncserve.config import Environment, LoRAConfig, ServerConfig
from tests.http.conftest import ServerProcess
from tests.lora.conftest import TinyLoRA, hf_greedy

NO_ENV = Environment(api_key=None, default_model=None, log_level="INFO")


def test_lora_flags_map_to_configs() -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "--enable-lora",
            "--max-loras",
            "4",
            "--max-lora-rank",
            "32",
            "--max-cpu-loras",
            "8",
            "--lora-modules",
            "a=/ad/a",
            '{"name": "b", "path": "/ad/b", "base_model_name": "m"}',
        ]  # fmt: skip
    )
    lora = engine_config_from_args(args, NO_ENV).lora
    assert lora == LoRAConfig(enable_lora=True, max_loras=4, max_lora_rank=32, max_cpu_loras=8)
    server = server_config_from_args(args, NO_ENV)
    assert server.lora_modules == (("a", "/ad/a"), ("b", "/ad/b"))
    assert not server.allow_runtime_lora_updating
    env = Environment(None, None, "INFO", allow_runtime_lora_updating=True)
    assert server_config_from_args(args, env).allow_runtime_lora_updating


def test_environment_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCSERVE_ALLOW_RUNTIME_LORA_UPDATING", "True")
    assert Environment.read().allow_runtime_lora_updating
    monkeypatch.setenv("ASYNCSERVE_ALLOW_RUNTIME_LORA_UPDATING", "0")
    assert not Environment.read().allow_runtime_lora_updating


@pytest.mark.parametrize("text", ["a", "=/p", "a=", '{"name": "a"}', "{bad json"])
def test_bad_lora_modules(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_lora_module(text)


def test_lora_config_checks() -> None:
    with pytest.raises(ValueError, match="max_loras"):
        LoRAConfig(max_loras=0)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LoRAConfig(max_loras=4, max_cpu_loras=2)
    assert LoRAConfig(max_loras=3).cpu_capacity == 3
    with pytest.raises(ValueError, match="twice"):
        ServerConfig(lora_modules=(("a", "/x"), ("a", "/y")))


def test_serve_with_lora_modules(tiny_lora: TinyLoRA, tmp_path: Path) -> None:
    """`serve --enable-lora --lora-modules`: the adapter is listed and answers by name; a
    bad adapter in --lora-modules stops the start with one line and status 2."""
    a = tiny_lora.adapters[0]
    common = [str(tiny_lora.base_path), "--device", "cpu", "--dtype", "float32",
              "--kv-cache-memory", "4M", "--served-model-name", "base", "--enable-lora",
              "--max-lora-rank", "8"]  # fmt: skip
    server = ServerProcess([*common, "--lora-modules", f"ad-a={a.path}"], tmp_path)
    try:
        server.wait_ready()
        models = httpx.get(f"{server.base_url}/v1/models").json()["data"]
        assert [(m["id"], m["parent"]) for m in models] == [("base", None), ("ad-a", "base")]
        body = {"model": "ad-a", "prompt": [5, 9, 13], "max_tokens": 4, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        out = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60).json()
        assert out["choices"][0]["token_ids"] == hf_greedy(a.model, [5, 9, 13], 4)
    finally:
        assert server.stop() == 0
    # Rank 16 > --max-lora-rank 8.
    bad = ServerProcess([*common, "--lora-modules", f"c={tiny_lora.adapters[2].path}"], tmp_path)
    assert bad.proc.wait(120) == 2
    bad.stop()
    assert "max_lora_rank=8" in bad.logs() and "Traceback" not in bad.logs()
