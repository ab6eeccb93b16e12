"""Tensor parallelism on CPU (gloo, 2 worker processes): greedy output equal to one device,
token for token, through chunked prefill, prefix hits and preemption; a killed worker ends
the engine with a clear error and no process left behind; workers ignore SIGTERM yet end
with the engine process; bad sizes fail before any start.

SmolLM2-135M (the default model) has 9 attention heads, which 2 ranks cannot split, so the
equality runs on a small Llama checkpoint (random weights, safetensors) and the default
model is the bad-size case.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors.torch import save_file

from asyncserve import LLM, RequestOutput, SamplingParams
from asyncserve.executor.multiproc import MultiProcExecutor, check_devices
from asyncserve.sampling_params import StructuredOutputsParams
from tests.models.test_families import save_tiny_family
from tests.models.test_loader import random_state, write_config

# Small steps (chunked prefill) and a small pool (preemption); blocks of 4 tokens.
ENGINE_ARGS = {
    "device": "cpu",
    "dtype": "float32",
    "block_size": 4,
    "max_num_batched_tokens": 16,
    "num_gpu_blocks_override": 24,
    "max_model_len": 96,  # what 24 blocks of 4 hold
}
SHARED = list(range(10, 34))  # 6 full blocks: later prompts hit the prefix cache


def _prompts() -> list[list[int]]:
    prompts = [SHARED + [40 + i, 41 + i] for i in range(4)]
    prompts += [list(range(100, 140)), [7, 8, 9], list(range(200, 230))]
    return prompts


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = write_config(tmp_path_factory.mktemp("tp") / "llama")
    save_file(random_state(seed=3), str(root / "model.safetensors"))
    return root


@pytest.fixture(scope="module")
def tp_llm(checkpoint: Path) -> Iterator[LLM]:
    llm = LLM(str(checkpoint), tensor_parallel_size=2, **ENGINE_ARGS)  # type: ignore[arg-type]
    yield llm
    llm.close()


def _generate(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    first = llm.generate(_prompts()[:1], params, use_tqdm=False)  # fills the prefix cache
    rest = llm.generate(_prompts()[1:], params, use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in first + rest]


@pytest.fixture(scope="module")
def single_llm(checkpoint: Path) -> Iterator[LLM]:
    llm = LLM(str(checkpoint), **ENGINE_ARGS)  # type: ignore[arg-type]
    yield llm
    llm.close()


def test_tp2_greedy_equals_one_device(single_llm: LLM, tp_llm: LLM) -> None:
    expected = _generate(single_llm)
    assert _generate(tp_llm) == expected
    assert all(len(ids) == 12 for ids in expected)
    scheduler = tp_llm.engine.scheduler
    assert scheduler.num_preemptions_total > 0
    assert scheduler.prefix_cache_hits > 0
    # The pool took every block back.
    assert tp_llm.engine.num_free_blocks == tp_llm.engine.num_blocks


def test_tp2_logprobs_come_from_rank_0(single_llm: LLM, tp_llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, prompt_logprobs=2)
    (want,) = single_llm.generate([list(range(50, 70))], params, use_tqdm=False)
    (got,) = tp_llm.generate([list(range(50, 70))], params, use_tqdm=False)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.outputs[0].logprobs is not None and want.outputs[0].logprobs is not None
    for got_row, want_row in zip(got.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
        assert list(got_row) == list(want_row)
        for token, entry in want_row.items():
            assert got_row[token].logprob == pytest.approx(entry.logprob, abs=1e-4)
    assert got.prompt_logprobs is not None and want.prompt_logprobs is not None
    assert len(got.prompt_logprobs) == len(want.prompt_logprobs)
    for got_row, want_row in zip(got.prompt_logprobs, want.prompt_logprobs, strict=True):
        assert (got_row is None) == (want_row is None)
        for token, entry in (want_row or {}).items():
            assert got_row is not None
            assert got_row[token].logprob == pytest.approx(entry.logprob, abs=1e-4)


def test_tp2_seeded_sampling_and_n_equal_one_device(single_llm: LLM, tp_llm: LLM) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.9, n=2, seed=17, max_tokens=8,
                            ignore_eos=True)  # fmt: skip
    prompts = [list(range(60, 75)), [9, 8, 7, 6]]
    want = single_llm.generate(prompts, params, use_tqdm=False)
    got = tp_llm.generate(prompts, params, use_tqdm=False)
    for w, g in zip(want, got, strict=True):
        assert [o.token_ids for o in g.outputs] == [o.token_ids for o in w.outputs]


def test_tp2_structured_output_equals_one_device(single_llm: LLM, tp_llm: LLM) -> None:
    pattern = r"[a-d]{3}-[0-9]{2}"
    params = SamplingParams(temperature=0.0, max_tokens=12,
                            structured_outputs=StructuredOutputsParams(regex=pattern))  # fmt: skip
    (want,) = single_llm.generate([list(range(20, 30))], params, use_tqdm=False)
    (got,) = tp_llm.generate([list(range(20, 30))], params, use_tqdm=False)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert re.fullmatch(pattern, got.outputs[0].text), got.outputs[0].text


def test_only_the_driver_materialises_full_vocab_logits(single_llm: LLM, tp_llm: LLM) -> None:
    # Every op on each rank is watched (worker/vocab_watch.py): rank 1 sends its slice of
    # the logits to rank 0 and never holds a tensor as wide as the vocabulary.
    executor = tp_llm.engine.executor
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=4, logprobs=2, prompt_logprobs=1)
    executor.collective_rpc("watch_full_vocab", True)
    try:
        (got,) = tp_llm.generate([list(range(50, 62))], params, use_tqdm=False)
    finally:
        counts = executor.collective_rpc("watch_full_vocab", False)
    assert counts[0] > 0 and counts[1] == 0, counts
    (want,) = single_llm.generate([list(range(50, 62))], params, use_tqdm=False)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.prompt_logprobs is not None and len(got.prompt_logprobs) == 12


def test_workers_load_new_weights_from_a_directory(
    tmp_path: Path, checkpoint: Path, single_llm: LLM, tp_llm: LLM
) -> None:
    # What `bench throughput --peer hf` does under tensor parallelism (the peer's weights).
    other = write_config(tmp_path / "other")
    save_file(random_state(seed=9), str(other / "model.safetensors"))
    before = _generate(tp_llm)
    try:
        outputs = []
        for llm in (single_llm, tp_llm):
            llm.engine.executor.collective_rpc("load_weights_from", str(other))
            assert llm.engine.scheduler.reset_prefix_cache()  # its KV came from the old weights
            outputs.append(_generate(llm))
        assert outputs[0] == outputs[1] != before
    finally:
        for llm in (single_llm, tp_llm):
            llm.engine.executor.collective_rpc("load_weights_from", str(checkpoint))
            llm.engine.scheduler.reset_prefix_cache()


def test_replicated_kv_head_equals_one_device(tmp_path: Path) -> None:
    # One KV head, two ranks: each rank holds a copy of it.
    state = random_state(seed=5)
    for i in range(2):
        for name in ("k_proj", "v_proj"):
            key = f"model.layers.{i}.self_attn.{name}.weight"
            state[key] = state[key][:8].contiguous()
    root = write_config(tmp_path / "kv1", num_key_value_heads=1)
    save_file(state, str(root / "model.safetensors"))
    outputs = []
    for size in (1, 2):
        llm = LLM(str(root), tensor_parallel_size=size, **ENGINE_ARGS)  # type: ignore[arg-type]
        try:
            outputs.append(_generate(llm))
        finally:
            llm.close()
    assert outputs[0] == outputs[1]


def test_tp2_async_scheduling_equals_one_device(checkpoint: Path, tp_llm: LLM) -> None:
    expected = _generate(tp_llm)
    llm = LLM(str(checkpoint), tensor_parallel_size=2, async_scheduling=True, **ENGINE_ARGS)  # type: ignore[arg-type]
    try:
        assert _generate(llm) == expected
    finally:
        llm.close()


def test_tp2_expert_parallel_equals_one_device(tmp_path: Path) -> None:
    # Qwen3-MoE: 8 experts, four on each rank, and one dense layer split as Llama's.
    save_tiny_family("qwen3_moe", tmp_path)
    outputs = []
    for size, expert_parallel in ((1, False), (2, True)):
        llm = LLM(
            str(tmp_path),
            tensor_parallel_size=size,
            enable_expert_parallel=expert_parallel,
            **ENGINE_ARGS,  # type: ignore[arg-type]
        )
        try:
            outputs.append(_generate(llm))
        finally:
            llm.close()
    assert outputs[0] == outputs[1]


def _gone(pid: int) -> bool:
    """Ended: no such process, or a zombie left for a reaper that is not this test."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_workers_ignore_sigterm_until_shutdown(checkpoint: Path) -> None:
    # A service manager's SIGTERM to the process group reaches the workers too: they keep
    # serving while the engine process drains, and end when it shuts them down.
    llm = LLM(str(checkpoint), tensor_parallel_size=2, **ENGINE_ARGS)  # type: ignore[arg-type]
    try:
        executor = llm.engine.executor
        assert isinstance(executor, MultiProcExecutor)
        pids = executor.pids
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

        async def run() -> RequestOutput:
            last = None
            async for out in llm.engine.generate([5, 6, 7], params, "terminated"):
                if last is None:
                    for pid in pids:
                        os.kill(pid, signal.SIGTERM)
                last = out
            assert last is not None
            return last

        out = llm._loop.run_until_complete(run())
        assert out.error is None and len(out.outputs[0].token_ids) == 24
        assert llm.engine._dead_reason is None and not any(_gone(pid) for pid in pids)
    finally:
        start = time.monotonic()
        llm.close()
    assert time.monotonic() - start < 5  # "stop" ended them, not the grace and a SIGKILL
    assert all(_gone(pid) for pid in pids)
    assert not [p for p in multiprocessing.active_children() if p.pid in pids]


_ENGINE_SCRIPT = """
import sys
from asyncserve import LLM
llm = LLM(sys.argv[1], tensor_parallel_size=2, device="cpu", dtype="float32",
          max_model_len=64, num_gpu_blocks_override=8)
print(*llm.engine.executor.pids, flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("end", ["exit", "sigkill"])
def test_workers_end_with_the_engine_process(checkpoint: Path, end: str) -> None:
    # Workers that ignore SIGTERM still end with the engine process: one that exits without
    # LLM.close() shuts them down at exit (multiprocessing's own exit handler would SIGTERM
    # them and wait forever); one killed outright is noticed by the workers themselves.
    proc = subprocess.Popen(
        [sys.executable, "-c", _ENGINE_SCRIPT, str(checkpoint)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdin is not None and proc.stdout is not None
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        time.sleep(0.5)
        assert not any(_gone(pid) for pid in pids)
        if end == "exit":
            proc.stdin.close()
            assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(_gone(pid) for pid in pids):
        time.sleep(0.05)
    assert all(_gone(pid) for pid in pids)


def test_killed_worker_ends_the_engine(tp_llm: LLM) -> None:
    executor = tp_llm.engine.executor
    assert isinstance(executor, MultiProcExecutor)
    pids = executor.pids
    engine = tp_llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)

    async def run() -> RequestOutput:
        # Killed mid-run, once the first token is out: the steps in flight fail.
        last = None
        async for out in engine.generate([5, 6, 7], params, "killed"):
            if last is None:
                os.kill(pids[1], signal.SIGKILL)
            last = out
        assert last is not None
        return last

    out = tp_llm._loop.run_until_complete(run())
    assert out.error is not None and "worker 1" in out.error and "died" in out.error
    assert len(out.outputs[0].token_ids) < 50
    assert "died" in tp_llm.engine._dead_reason  # type: ignore[operator]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and multiprocessing.active_children():
        time.sleep(0.05)
    assert not multiprocessing.active_children()
    for pid in pids:  # reaped: no orphan left
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_worker_failing_to_load_ends_every_worker(tmp_path: Path) -> None:
    # The engine process reads no weights under tensor parallelism: the workers find the gap.
    state = random_state(seed=3)
    del state["model.layers.1.mlp.down_proj.weight"]
    root = write_config(tmp_path / "broken")
    save_file(state, str(root / "model.safetensors"))
    with pytest.raises(RuntimeError, match=r"worker \d failed: ValueError: checkpoint is missing"):
        LLM(str(root), tensor_parallel_size=2, **ENGINE_ARGS)  # type: ignore[arg-type]
    assert not multiprocessing.active_children()


def test_bad_tensor_parallel_size_fails_before_any_process() -> None:
    # SmolLM2-135M has 9 attention heads.
    with pytest.raises(ValueError, match=r"must divide the number of attention heads \(9\)"):
        LLM(device="cpu", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        LLM(device="cpu", tensor_parallel_size=0)
    with pytest.raises(ValueError, match="enable_expert_parallel needs a mixture-of-experts"):
        LLM(device="cpu", enable_expert_parallel=True)
    assert not multiprocessing.active_children()


def test_more_ranks_than_gpus_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(2\) exceeds the 1 visible"):
        check_devices(2, torch.device("cuda"))
    check_devices(2, torch.device("cpu"))
    # Enough GPUs, but a torch without NCCL (the CPU build this runs on has none).
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: False)
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(2\) on CUDA needs NCCL"):
        check_devices(2, torch.device("cuda"))
