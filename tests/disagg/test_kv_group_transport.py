"""KV blocks over a process group (PyNcclConnector / P2pNcclConnector): gloo on the CPU, the
same code path NCCL takes between GPUs. A producer and a consumer on loopback give one
server's greedy tokens, the prompt's blocks coming over the group; blocks the consumer holds
are not sent again; a dead peer fails that transfer only and the pair re-forms with a
restarted one; a stalled or out-of-step peer is a clear error; bad configs are one line."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save_file

from asyncserve.config import EngineConfig, KVTransferConfig
from asyncserve.disagg.kv_group import KVGroup, KVGroupError
from tests.disagg.test_disagg_tensor_parallel import BLOCK, _answer, _complete, _same, _through
from tests.disagg.test_disaggregated_prefill import _counter
from tests.http.conftest import ServerProcess, free_port
from tests.models.test_loader import random_state, write_config

pytestmark = pytest.mark.timeout(300)


def _group_config(role: str, rank: int, port: int, connector: str = "PyNcclConnector") -> str:
    return json.dumps({"kv_connector": connector, "kv_role": role, "kv_rank": rank,
                       "kv_parallel_size": 2, "kv_ip": "127.0.0.1", "kv_port": port,
                       "kv_connector_extra_config": {"transfer_timeout_s": 5}})  # fmt: skip


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("kv-group")
    root = write_config(tmp / "llama")
    save_file(random_state(seed=5), str(root / "model.safetensors"))
    common = ["--model", str(root), "--device", "cpu", "--dtype", "float32", "--block-size",
              str(BLOCK), "--max-model-len", "128", "--kv-cache-memory", "2M",
              "--shutdown-timeout", "2"]  # fmt: skip
    port = free_port()

    def start(role: str, rank: int, connector: str, tp: int = 1) -> ServerProcess:
        config = _group_config(role, rank, port, connector)
        return ServerProcess([*common, "-tp", str(tp), "--kv-transfer-config", config], tmp)

    # The consumer hosts the group's store (rank 0): it outlives a producer that dies.
    state: dict[str, Any] = {
        "consumer": start("kv_consumer", 0, "PyNcclConnector"),
        "producer": start("kv_producer", 1, "P2pNcclConnector"),
        "start": lambda tp: start("kv_producer", 1, "PyNcclConnector", tp),
    }
    try:
        state["consumer"].wait_ready()
        state["producer"].wait_ready()
        yield state
    finally:
        for server in (state["producer"], state["consumer"]):
            server.stop()


def test_greedy_over_the_group_equals_one_server(pair: dict[str, Any]) -> None:
    producer, consumer = pair["producer"], pair["consumer"]
    prompt = list(range(20, 60))
    reference = _answer(_complete(producer, prompt))  # computed there, in full
    sent = _counter(producer.base_url, "kv_transfer_blocks_sent")
    _same(_through(producer, consumer, prompt), reference)
    assert _counter(producer.base_url, "kv_transfer_blocks_sent") - sent == (40 - 1) // BLOCK
    assert "KV group 127.0.0.1" in consumer.logs()  # the blocks came over the group (gloo)
    # Blocks the consumer caches now are not sent again.
    sent = _counter(producer.base_url, "kv_transfer_blocks_sent")
    prefilled = _complete(producer, prompt, max_tokens=1,
                          kv_transfer_params={"do_remote_decode": True})  # fmt: skip
    params = {**prefilled["kv_transfer_params"], "remote_url": producer.base_url}
    _same(_answer(_complete(consumer, prompt, kv_transfer_params=params)), reference)
    assert _counter(producer.base_url, "kv_transfer_blocks_sent") == sent


def test_dead_producer_fails_its_request_and_a_restarted_one_rejoins(
    pair: dict[str, Any],
) -> None:
    producer, consumer = pair["producer"], pair["consumer"]
    prompt = list(range(70, 100))
    prefilled = _complete(producer, prompt, max_tokens=1,
                          kv_transfer_params={"do_remote_decode": True})  # fmt: skip
    params = {**prefilled["kv_transfer_params"], "remote_url": producer.base_url}
    producer.proc.kill()
    producer.stop()
    lost = _complete(consumer, prompt, kv_transfer_params=params)
    assert lost["choices"][0]["finish_reason"] == "error"
    assert f"KV transfer from {producer.base_url} failed" in consumer.logs()
    assert _complete(consumer, [5, 6, 7])["choices"][0]["finish_reason"] == "length"
    # A new producer takes rank 1: the pair forms again under the consumer's next token. It
    # runs two tensor-parallel ranks, whose head slices it joins before sending.
    pair["producer"] = restarted = pair["start"](2)
    restarted.wait_ready()
    prompt = list(range(110, 150))
    reference = _answer(_complete(restarted, prompt))
    _same(_through(restarted, consumer, prompt), reference)


def test_a_pull_for_another_group_is_refused(pair: dict[str, Any]) -> None:
    producer = pair["producer"]
    body = {"request_id": "x", "block_hashes": [],
            "kv_group": {"address": "10.0.0.1:1", "token": "t", "transfer_id": 1}}  # fmt: skip
    reply = httpx.post(f"{producer.base_url}/kv_transfer/pull", json=body, timeout=30)
    assert reply.status_code == 400 and "KV group is at 127.0.0.1" in reply.text


# ---- the group on its own: two ranks in one process -------------------------------------


# NCCL (one GPU per rank, both ranks in this process) where two GPUs are; gloo always.
BACKENDS = [
    "gloo",
    pytest.param("nccl", marks=pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason="NCCL between two GPUs")),
]  # fmt: skip


@pytest.fixture(params=BACKENDS)
def groups(request: pytest.FixtureRequest) -> Iterator[tuple[KVGroup, KVGroup]]:
    port = free_port()
    made = []
    for rank in (0, 1):
        config = KVTransferConfig.from_dict(json.loads(_group_config(
            "kv_consumer" if rank == 0 else "kv_producer", rank, port)))  # fmt: skip
        device = torch.device("cuda", rank) if request.param == "nccl" else torch.device("cpu")
        made.append(KVGroup(replace(config, kv_group_timeout_s=1.0), device))
    try:
        yield made[0], made[1]
    finally:
        for group in made:
            group.close()


def test_a_stalled_peer_times_out_then_the_pair_reforms(groups: tuple[KVGroup, KVGroup]) -> None:
    consumer, producer = groups
    token = consumer.new_token("p")
    joined = producer._thread.submit(producer._join, token)  # joins, never sends
    with pytest.raises(KVGroupError, match="KV group at 127.0.0.1"):
        consumer.recv(token, 1, torch.float32).result(30)
    joined.result(5)
    again = consumer.new_token("p")
    assert again != token  # the failed group is gone: the next pull forms a new one
    data = torch.randn(2, 2, 2, 4, 2, 8, device=producer.device)
    sent = producer.send(again, 2, data)
    got = consumer.recv(again, 2, torch.float32).result(30)
    assert got.device == consumer.device and torch.equal(got.cpu(), data.cpu())
    sent.result(5)


def test_transfers_reuse_the_formed_group(groups: tuple[KVGroup, KVGroup]) -> None:
    consumer, producer = groups
    for transfer_id in (1, 2, 3):
        token = consumer.new_token("p")
        data = torch.full((1, 1, 2, 4, 2, 8), float(transfer_id), device=producer.device)
        sent = producer.send(token, transfer_id, data)
        got = consumer.recv(token, transfer_id, torch.float32).result(30)
        assert torch.equal(got.cpu(), data.cpu())
        sent.result(30)
    assert consumer.groups_formed == producer.groups_formed == 1


def test_an_out_of_step_payload_is_an_error(groups: tuple[KVGroup, KVGroup]) -> None:
    consumer, producer = groups
    token = consumer.new_token("p")
    producer.send(token, 7, torch.zeros(1, 1, 2, 4, 2, 8, device=producer.device))
    with pytest.raises(KVGroupError, match="transfer 7 arrived while 8 was expected"):
        consumer.recv(token, 8, torch.float32).result(30)


def test_a_peer_that_goes_away_fails_the_transfer(groups: tuple[KVGroup, KVGroup]) -> None:
    consumer, producer = groups
    token = consumer.new_token("p")
    sent = producer.send(token, 1, torch.zeros(1, 1, 2, 4, 2, 8, device=producer.device))
    assert consumer.recv(token, 1, torch.float32).result(30).shape == (1, 1, 2, 4, 2, 8)
    sent.result(30)
    pending = consumer.recv(token, 2, torch.float32)
    threading.Timer(0.2, producer.close).start()
    with pytest.raises(KVGroupError):
        pending.result(30)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"kv_rank": 0}, "needs kv_ip and kv_port"),
        ({"kv_rank": 0, "kv_ip": "127.0.0.1"}, "needs kv_ip and kv_port"),
        ({"kv_rank": 2, "kv_ip": "127.0.0.1", "kv_port": 4000}, "kv_rank must be 0 or 1"),
        ({"kv_ip": "127.0.0.1", "kv_port": 4000}, "kv_rank must be 0 or 1"),
        ({"kv_rank": 0, "kv_ip": "h", "kv_port": 4000, "kv_parallel_size": 3},
         "kv_parallel_size must be 2"),
        ({"kv_rank": 0, "kv_ip": "h", "kv_port": 70000}, "kv_port must be in 1..65535"),
        ({"kv_rank": 0, "kv_ip": "h", "kv_port": 4000, "kv_role": "kv_both"},
         "kv_both needs the TCPConnector"),
    ],
)  # fmt: skip
def test_config_errors_are_one_line(raw: dict[str, Any], message: str) -> None:
    config = {"kv_connector": "P2pNcclConnector", "kv_role": "kv_producer", **raw}
    with pytest.raises(ValueError, match=message) as error:
        EngineConfig.from_engine_args(kv_transfer_config=config)
    assert "\n" not in str(error.value)
