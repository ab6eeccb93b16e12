"""LLM(data_parallel_size=2) on CPU: two replica processes of the default model; greedy
outputs in input order equal to one engine's, aborts reach the replica, bad sizes fail
before any process starts, and a killed replica fails its requests with a clear error."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator

import pytest
import torch

from asyncserve import LLM, SamplingParams
from asyncserve.config import Environment
from asyncserve.engine.dp_client import DataParallelClient
from asyncserve.engine.dp_processes import replica_devices
from asyncserve.outputs import RequestOutput
from asyncserve.sampling_params import RequestOutputKind
from tests.conftest import PLAIN_PROMPTS

pytestmark = pytest.mark.timeout(300)

SHARED = "You are a helpful assistant. Answer in one short sentence, please: "


def _prompts() -> list[str | list[int]]:
    prompts: list[str | list[int]] = list(PLAIN_PROMPTS)
    prompts += [SHARED + "what is the sun?", SHARED + "what is rain?", [1, 504, 3458, 314]]
    return prompts


@pytest.fixture(scope="module")
def dp_llm(gguf_path: object) -> Iterator[LLM]:
    llm = LLM(device="cpu", max_model_len=512, kv_cache_memory=64 << 20, data_parallel_size=2)
    yield llm
    llm.close()


def test_dp2_greedy_equals_one_engine(smollm2_llm: LLM, dp_llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=10)
    expected = smollm2_llm.generate(_prompts(), params, use_tqdm=False)
    got = dp_llm.generate(_prompts(), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in expected]
    assert [o.prompt for o in got] == [o.prompt for o in expected]
    client = dp_llm.engine
    assert isinstance(client, DataParallelClient)
    assert all(n > 0 for n in client.balancer.num_chosen), client.balancer.num_chosen
    # Every request finished: nothing outstanding anywhere.
    assert client.balancer.load == [0, 0]
    # A bad request is answered in place, in order, without reaching a replica.
    bad = dp_llm.generate(["Hi", list(range(600))], params, use_tqdm=False)
    assert bad[0].error is None and bad[1].error is not None
    assert "max_model_len" in bad[1].error


def test_abort_reaches_the_replica(dp_llm: LLM) -> None:
    client = dp_llm.engine
    assert isinstance(client, DataParallelClient)
    params = SamplingParams(
        temperature=0.0, max_tokens=400, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )

    async def read_two_then_leave() -> int:
        seen = 0
        stream = client.generate("Tell me a long story", params, "abort-me")
        async for _ in stream:
            seen += 1
            if seen == 2:
                break
        await stream.aclose()  # the generator's cleanup aborts the request
        for _ in range(200):  # the replica answers with the request's last output
            if "abort-me" not in client._requests and client.num_running == 0:
                break
            await asyncio.sleep(0.05)
        return seen

    assert dp_llm._loop.run_until_complete(read_two_then_leave()) == 2
    assert "abort-me" not in client._requests
    assert client.num_running == 0 and client.balancer.load == [0, 0]


def test_bad_sizes_fail_before_any_process_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="data_parallel_size must be >= 1"):
        LLM(device="cpu", data_parallel_size=0)
    n = torch.cuda.device_count() + 1
    with pytest.raises(ValueError, match=rf"\({n} x 1 = {n}\) exceeds the {n - 1} visible"):
        replica_devices(n, 1, torch.device("cuda"))
    monkeypatch.setenv("ASYNCSERVE_DP_SIZE", "2")
    monkeypatch.setenv("ASYNCSERVE_DP_RANK", "2")
    with pytest.raises(ValueError, match=r"ASYNCSERVE_DP_RANK must be in \[0, 2\)"):
        Environment.read()
    monkeypatch.setenv("ASYNCSERVE_DP_RANK", "one")
    with pytest.raises(ValueError, match="ASYNCSERVE_DP_RANK must be an integer"):
        Environment.read()


def test_serve_refuses_bad_sizes_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from asyncserve.cli import main

    n = torch.cuda.device_count() + 2  # at least 2: one replica is no data parallelism
    assert main(["serve", "--device", "cuda", "-dp", str(n), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    # Without CUDA at all, the device is what is wrong; with it, the sizes.
    want = f"({n} x 1 = {n}) exceeds the" if torch.cuda.is_available() else "no CUDA device"
    assert err.count("\n") == 0 and want in err, err
    with pytest.raises(ValueError, match=rf"\({n} x 1 = {n}\) exceeds the"):
        replica_devices(n, 1, torch.device("cuda"))
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "-dp", "0"])
    assert exit_info.value.code == 2
    assert "--data-parallel-size/-dp: must be >= 1" in capsys.readouterr().err


def test_cuda_devices_per_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert replica_devices(2, 2, torch.device("cuda")) == [["4", "5"], ["6", "7"]]
    assert replica_devices(2, 2, torch.device("cpu")) is None
    with pytest.raises(ValueError, match=r"\(3 x 2 = 6\) exceeds the 4 visible CUDA devices"):
        replica_devices(3, 2, torch.device("cuda"))


def test_killed_replica_fails_its_requests(dp_llm: LLM) -> None:
    """Last in the module: it ends one of the shared engine's replicas, then the engine."""
    client = dp_llm.engine
    assert isinstance(client, DataParallelClient)
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def run() -> list[RequestOutput]:
        async def one(prompt: str, rid: str) -> RequestOutput:
            last = None
            async for out in client.generate(prompt, params, rid):
                last = out
            assert last is not None and last.finished
            return last

        tasks = [
            asyncio.ensure_future(one(p, f"kill-{i}"))
            for i, p in enumerate(["A long story:", "Another long story:"])
        ]
        while min(client.balancer.load) == 0:  # both replicas hold a request
            await asyncio.sleep(0.01)
        os.kill(client.pids[0], signal.SIGKILL)
        reason = await asyncio.wait_for(client.wait_until_dead(), 30)
        assert "data-parallel replica 0" in reason and "died" in reason
        assert not client.is_running  # what /health reads
        # The survivor drains; a request abandoned during the drain (a stream the server
        # cut at its deadline) is aborted there rather than run to its end.
        shutdown = asyncio.ensure_future(client.shutdown(timeout=120))
        await asyncio.sleep(0.2)
        for request_id, tracked in list(client._requests.items()):
            assert tracked.replica == 1
            await client.abort(request_id)
        await asyncio.wait_for(shutdown, 60)
        return list(await asyncio.gather(*tasks))

    outs = dp_llm._loop.run_until_complete(run())
    errors = [o.error for o in outs]
    # The request on the killed replica failed naming it; the other was aborted.
    assert any(e is not None and "data-parallel replica 0" in e for e in errors), errors
    survivor = next(o.outputs[0] for o in outs if o.error is None)
    assert survivor.finish_reason == "abort" and len(survivor.token_ids) < 400, survivor
    assert not any(p.is_alive() for p in client._replicas.procs)
