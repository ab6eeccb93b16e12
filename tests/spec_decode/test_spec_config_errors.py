"""Hostile --speculative-config values and head folders: each is a one-line ValueError at
start naming the key or the file (the CLI prints it without a traceback), never a crash."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from asyncserve.spec_decode.config import SpeculativeConfig
from tests.spec_decode.test_eagle3 import _draft_ids, _head_tensors, _llm, _save_head, _spec
from tests.spec_decode.test_eagle3 import target as target  # noqa: F401 (fixture)
from tests.test_cli import free_port, run_serve

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"method": "ngram", "num_speculative_tokens": "four"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 1e9}, "num_speculative_tokens"),
        ({"method": "eagle3"}, "num_speculative_tokens"),
        ({"method": "eagle3", "num_speculative_tokens": 2}, "method 'eagle3' needs a model"),
        ({"model": 5, "num_speculative_tokens": 2}, "model must be a path"),
        ({"model": ["a"], "num_speculative_tokens": 2}, "model must be a path"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": -1},
         "prompt_lookup_max must be an integer >= 1, got -1"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": "2"},
         "prompt_lookup_min must be an integer >= 1"),
        ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
        ({"method": "ngram", "num_speculative_tokens": 2, "x": 1}, "unknown key"),
        ("[1, 2]", "must be a JSON object"),
        ("{bad", "not valid JSON"),
    ],
)  # fmt: skip
def test_bad_values_name_the_key(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        SpeculativeConfig.from_value(value)  # type: ignore[arg-type]
    assert "\n" not in str(info.value)


def _corrupt(head: Path, what: str) -> None:
    config = head / "config.json"
    if what == "bad json":
        config.write_text("{bad")
    elif what == "json list":
        config.write_text("[1]")
    elif what == "string value":
        config.write_text(json.dumps({**json.loads(config.read_text()), "hidden_size": "big"}))
    elif what == "bad int":
        data = {**json.loads(config.read_text()), "max_position_embeddings": [1]}
        config.write_text(json.dumps(data))
    elif what == "garbage tensors":
        (head / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json")
    elif what == "wrong shape":
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(head / "model.safetensors"))
        tensors["midlayer.mlp.up_proj.weight"] = torch.zeros(3, 5)
        save_file(tensors, str(head / "model.safetensors"))


@pytest.mark.parametrize(
    ("what", "method", "message"),
    [
        ("bad json", "eagle3", r"cannot read .*config.json"),
        ("json list", "eagle3", "config.json must hold a JSON object"),
        ("json list", "eagle", "config.json must hold a JSON object"),
        ("string value", "eagle3", "hidden_size must be an integer"),
        ("bad int", "eagle3", "cannot load the EAGLE-3 head"),
        ("garbage tensors", "eagle3", "cannot load the EAGLE-3 head"),
        ("garbage tensors", "eagle", "cannot load the EAGLE head"),
        ("wrong shape", "eagle3", "up_proj"),
    ],
)
def test_broken_head_folders_are_one_line_errors(
    target: Path,  # noqa: F811
    tmp_path: Path,
    what: str,
    method: str,
    message: str,
) -> None:
    head = Path(_save_head(tmp_path / "head", _head_tensors(target, 4, _draft_ids(4))))
    if method == "eagle":  # an EAGLE-1 head names a plain Llama class
        config = json.loads((head / "config.json").read_text())
        (head / "config.json").write_text(json.dumps({**config, "architectures": ["Llama"]}))
    _corrupt(head, what)
    with pytest.raises(ValueError, match=message) as info:
        _llm(target, {**_spec(str(head)), "method": method})
    assert "\n" not in str(info.value)


def test_serve_prints_one_line_for_a_broken_head(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("[1]")
    spec = {"method": "eagle3", "model": str(tmp_path), "num_speculative_tokens": 2}
    result = run_serve("--port", str(free_port()), "--max-model-len", "128",
                       "--kv-cache-memory", "8M", "--speculative-config", json.dumps(spec))  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    [error] = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert "config.json must hold a JSON object" in error
