"""The Ray executor on a simulated two-node cluster (gloo on CPU): tensor parallelism over
Ray actors equals one device token for token, on one node and across both, and so does
pipeline parallelism (2 stages x 2 ranks); a cluster too small is a one-line error before
any load; a killed actor (busy or idle) or a lost node ends the engine with a clear error
and frees its placement group. KV blocks (disaggregated prefill's pool work) travel between
the engine and the actors by value, queued behind the steps.

The model is a small Llama checkpoint with random weights: SmolLM2-135M's 9 attention heads
cannot be split in two."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from asyncserve import LLM, RequestOutput, SamplingParams
from asyncserve.executor.ray_cluster import check_capacity
from asyncserve.executor.ray_executor import RayExecutor
from asyncserve.worker.kv_blocks import merge_rank_heads
from tests.engine.test_tensor_parallel import ENGINE_ARGS, _generate
from tests.ray.conftest import NODE_ARGS


@pytest.fixture(scope="module")
def checkpoint(tiny_llama: Path) -> Path:
    return tiny_llama


@pytest.fixture(scope="module")
def expected(checkpoint: Path) -> list[list[int]]:
    llm = LLM(str(checkpoint), **ENGINE_ARGS)  # type: ignore[arg-type]
    try:
        return _generate(llm)
    finally:
        llm.close()


def _ray_llm(checkpoint: Path, strategy: str) -> LLM:
    return LLM(
        str(checkpoint),
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
        ray_placement_strategy=strategy,
        **ENGINE_ARGS,  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def spread_llm(ray_cluster: Any, checkpoint: Path) -> Iterator[LLM]:
    llm = _ray_llm(checkpoint, "SPREAD")
    yield llm
    llm.close()


def test_tp2_across_two_nodes_equals_one_device(
    spread_llm: LLM, expected: list[list[int]], checkpoint: Path
) -> None:
    executor = spread_llm.engine.executor
    assert isinstance(executor, RayExecutor)
    assert len(set(executor.nodes)) == 2  # one rank on each simulated node
    assert _generate(spread_llm) == expected
    assert spread_llm.engine.scheduler.num_preemptions_total > 0
    assert spread_llm.engine.num_free_blocks == spread_llm.engine.num_blocks
    # Pool work (disaggregated prefill's block copies) queues behind the steps without
    # holding its caller: here the step thread is still busy when submit_rpc returns.
    executor._thread.submit(time.sleep, 0.5)
    blocks = executor.submit_rpc("read_kv_blocks", [0, 1])
    assert not blocks.done()
    parts = blocks.result(timeout=30)  # one reply a rank: its KV heads, by value
    # Blocks with every KV head go back the other way, each rank writing its own.
    kv_heads = json.loads((checkpoint / "config.json").read_text())["num_key_value_heads"]
    whole = merge_rank_heads(parts, kv_heads)
    assert executor.submit_rpc("write_kv_blocks", [5, 4], whole).result(timeout=30) == [None] * 2
    moved = executor.collective_rpc("read_kv_blocks", [5, 4])
    assert all(torch.equal(m, p) for m, p in zip(moved, parts, strict=True))


def test_tp2_on_one_node_equals_one_device(
    ray_cluster: Any, checkpoint: Path, expected: list[list[int]]
) -> None:
    llm = _ray_llm(checkpoint, "STRICT_PACK")
    try:
        executor = llm.engine.executor
        assert isinstance(executor, RayExecutor)
        assert len(set(executor.nodes)) == 1
        assert _generate(llm) == expected
        group = executor._group
        # An actor that dies while the engine is idle is reported without a step.
        ray.kill(executor.workers[0])
        deadline = time.monotonic() + 15
        while executor._failure is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert executor._failure is not None and "worker 0" in executor._failure
        with pytest.raises(RuntimeError, match="worker 0 .* died"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)
    finally:
        llm.close()
    # The engine gave its placement group back.
    assert ray.util.placement_group_table(group)["state"] == "REMOVED"


def test_cluster_without_enough_devices_fails_before_loading(
    ray_cluster: Any, checkpoint: Path
) -> None:
    with pytest.raises(
        ValueError, match=r"cannot place 4 CPU bundles \(STRICT_PACK\): the largest node has 3 CPUs"
    ):
        LLM(
            str(checkpoint),
            tensor_parallel_size=4,
            distributed_executor_backend="ray",
            **ENGINE_ARGS,  # type: ignore[arg-type]
        )
    nodes = [{"Alive": True, "Resources": {"GPU": 1.0}}] * 2
    with pytest.raises(ValueError, match="4 GPU bundles .*has 2 GPUs in all on 2 nodes"):
        check_capacity(4, "GPU", "SPREAD", nodes)
    check_capacity(2, "GPU", "SPREAD", nodes)


def test_killed_actor_ends_the_engine(spread_llm: LLM) -> None:
    executor = spread_llm.engine.executor
    assert isinstance(executor, RayExecutor)
    engine = spread_llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)

    async def run() -> RequestOutput:
        last = None
        async for out in engine.generate([5, 6, 7], params, "killed"):
            if last is None:
                ray.kill(executor.workers[1])
            last = out
        assert last is not None
        return last

    out = spread_llm._loop.run_until_complete(run())
    assert out.error is not None and "worker 1" in out.error and "died" in out.error
    assert len(out.outputs[0].token_ids) < 50
    assert "died" in (engine._dead_reason or "")
    group = executor._group
    spread_llm.close()
    assert ray.util.placement_group_table(group)["state"] == "REMOVED"


def test_pipeline_parallel_equals_one_device(
    ray_cluster: Any, checkpoint: Path, expected: list[list[int]]
) -> None:
    # Two stages of one layer each, two tensor-parallel ranks per stage, over both nodes;
    # async scheduling puts a second step behind the first in every stage.
    llm = LLM(
        str(checkpoint),
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        distributed_executor_backend="ray",
        ray_placement_strategy="SPREAD",
        async_scheduling=True,
        **ENGINE_ARGS,  # type: ignore[arg-type]
    )
    try:
        assert _generate(llm) == expected
        assert llm.engine.scheduler.num_preemptions_total > 0
    finally:
        llm.close()
    with pytest.raises(ValueError, match=r"pipeline_parallel_size \(3\) exceeds the number"):
        LLM(str(checkpoint), pipeline_parallel_size=3, distributed_executor_backend="ray")


def test_lost_node_ends_the_engine(ray_cluster: Any, checkpoint: Path) -> None:
    # The second simulated node goes away mid-request, taking its rank with it. STRICT_SPREAD:
    # the ranks must be on both nodes (SPREAD may pack them on the head while the other
    # node's CPUs are still held by an engine closed just before).
    llm = _ray_llm(checkpoint, "STRICT_SPREAD")
    worker_node = next(n for n in ray_cluster.list_all_nodes() if n is not ray_cluster.head_node)
    removed = False
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)

    async def run() -> RequestOutput:
        nonlocal removed
        last = None
        async for out in engine.generate([5, 6, 7], params, "lost"):
            if last is None:
                ray_cluster.remove_node(worker_node)
                removed = True
            last = out
        assert last is not None
        return last

    try:
        executor = llm.engine.executor
        assert isinstance(executor, RayExecutor)
        lost_rank = executor.nodes.index(worker_node.node_id)
        out = llm._loop.run_until_complete(run())
        # The lost rank, or its peer whose collective with it failed first, is named.
        assert out.error is not None and "died" in out.error
        assert f"worker {lost_rank} " in out.error or f"worker {1 - lost_rank} " in out.error
        assert len(out.outputs[0].token_ids) < 50
    finally:
        llm.close()
        if removed:
            ray_cluster.add_node(**NODE_ARGS)
            ray_cluster.wait_for_nodes()
