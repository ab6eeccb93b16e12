"""Disaggregated prefill under tensor parallelism (gloo on CPU): a producer and a consumer of
two ranks each, and a one-rank instance (kv_both) that is the reference and the other side
of the mixed pairs. Blocks travel with all the model's KV heads, so TP 2 -> 2, 1 -> 2 and
2 -> 1 all give one server's greedy tokens, the prompt's full blocks coming from the peer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from safetensors.torch import save_file

from asyncserve.config import EngineConfig
from tests.disagg.test_disaggregated_prefill import _counter
from tests.http.conftest import ServerProcess
from tests.models.test_loader import random_state, write_config

pytestmark = pytest.mark.timeout(300)
BLOCK = 8


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    tmp = tmp_path_factory.mktemp("disagg-tp")
    root = write_config(tmp / "llama")  # 2 KV heads: one per rank
    save_file(random_state(seed=3), str(root / "model.safetensors"))
    common = ["--model", str(root), "--device", "cpu", "--dtype", "float32", "--block-size",
              str(BLOCK), "--max-model-len", "128", "--kv-cache-memory", "2M",
              "--shutdown-timeout", "2"]  # fmt: skip

    def start(tp: int, role: str) -> ServerProcess:
        config = json.dumps({"kv_connector": "TCPConnector", "kv_role": role})
        return ServerProcess([*common, "-tp", str(tp), "--kv-transfer-config", config], tmp)

    started = {"producer": start(2, "kv_producer"), "consumer": start(2, "kv_consumer"),
               "single": start(1, "kv_both")}  # fmt: skip
    try:
        for server in started.values():
            server.wait_ready()
        yield started
    finally:
        for server in started.values():
            server.stop()


def _complete(server: ServerProcess, prompt: list[int], **extra: Any) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "logprobs": 1, **extra}  # fmt: skip
    reply = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    answer: dict[str, Any] = reply.json()
    return answer


def _answer(reply: dict[str, Any]) -> tuple[str, list[float]]:
    """The text and its tokens' logprobs (which K/V in the wrong heads would change)."""
    choice = reply["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"]


def _same(got: tuple[str, list[float]], want: tuple[str, list[float]]) -> None:
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], abs=1e-4)


def _through(
    producer: ServerProcess, consumer: ServerProcess, prompt: list[int]
) -> tuple[str, list[float]]:
    """Prefill on `producer`, decode on `consumer`: the answer, once every full block of
    the prompt came over and was a prefix hit."""
    prefilled = _complete(producer, prompt, max_tokens=1,
                          kv_transfer_params={"do_remote_decode": True})  # fmt: skip
    params = {**prefilled["kv_transfer_params"], "remote_url": producer.base_url}
    before = _counter(consumer.base_url, "kv_transfer_blocks_received")
    decoded = _complete(consumer, prompt, kv_transfer_params=params)
    received = _counter(consumer.base_url, "kv_transfer_blocks_received") - before
    assert received == (len(prompt) - 1) // BLOCK
    assert decoded["usage"]["prompt_tokens_details"]["cached_tokens"] == received * BLOCK
    return _answer(decoded)


def test_tp2_producer_to_tp2_consumer_equals_one_server(
    servers: dict[str, ServerProcess],
) -> None:
    prompt = list(range(20, 60))
    reference = _answer(_complete(servers["single"], prompt))
    _same(_through(servers["producer"], servers["consumer"], prompt), reference)


def test_tp1_producer_to_tp2_consumer(servers: dict[str, ServerProcess]) -> None:
    prompt = list(range(100, 137))
    via = _through(servers["single"], servers["consumer"], prompt)
    # The one-rank instance computed the prompt itself as the producer: its own answer.
    _same(via, _answer(_complete(servers["single"], prompt)))


def test_tp2_producer_to_tp1_consumer(servers: dict[str, ServerProcess]) -> None:
    prompt = list(range(150, 190))
    via = _through(servers["producer"], servers["single"], prompt)
    # The consumer now holds the prompt's blocks: a fresh computation, on the TP 2 consumer
    # (equal to one server, above), is the reference.
    _same(via, _answer(_complete(servers["consumer"], prompt)))


def test_a_different_model_is_a_clear_error(
    tmp_path: Path, servers: dict[str, ServerProcess]
) -> None:
    # Blocks of a model with 4 KV heads do not fit a pool of 2: the request fails, the
    # consumer says why and goes on serving.
    root = write_config(tmp_path / "kv4", num_key_value_heads=4)
    state = random_state(seed=4)
    for i in range(2):
        for name in ("k_proj", "v_proj"):
            key = f"model.layers.{i}.self_attn.{name}.weight"
            state[key] = state[key].repeat(2, 1)
    save_file(state, str(root / "model.safetensors"))
    config = json.dumps({"kv_connector": "TCPConnector", "kv_role": "kv_producer"})
    other = ServerProcess(["--model", str(root), "--device", "cpu", "--dtype", "float32",
                           "--block-size", str(BLOCK), "--max-model-len", "128",
                           "--kv-cache-memory", "2M", "--kv-transfer-config", config], tmp_path)  # fmt: skip
    try:
        other.wait_ready()
        prompt = list(range(40, 70))
        prefilled = _complete(other, prompt, max_tokens=1,
                              kv_transfer_params={"do_remote_decode": True})  # fmt: skip
        params = {**prefilled["kv_transfer_params"], "remote_url": other.base_url}
        failed = _complete(servers["consumer"], prompt, kv_transfer_params=params)
        assert failed["choices"][0]["finish_reason"] == "error"
        assert "KV heads" in servers["consumer"].logs()
        assert _complete(servers["consumer"], [5, 6, 7])["choices"][0]["finish_reason"]
    finally:
        other.stop()


def test_pipeline_stages_and_replicas_are_refused_before_any_start() -> None:
    kv = {"kv_connector": "TCPConnector", "kv_role": "kv_consumer"}
    with pytest.raises(
        ValueError, match="disaggregated prefill runs with pipeline_parallel_size 1"
    ):
        EngineConfig.from_engine_args(kv_transfer_config=kv, pipeline_parallel_size=2,
                                      distributed_executor_backend="ray")  # fmt: skip
    with pytest.raises(ValueError, match=r"one engine per instance \(data_parallel_size 1\)"):
        EngineConfig.from_engine_args(kv_transfer_config=kv, data_parallel_size=2)
    # Any tensor-parallel size is fine.
    assert EngineConfig.from_engine_args(kv_transfer_config=kv, tensor_parallel_size=2)
