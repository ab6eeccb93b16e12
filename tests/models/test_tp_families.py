"""Tensor and expert parallelism for the families beyond Llama: two gloo ranks (one spawned
pair for every case) compute the logits of a prompt in two chunks through the paged cache,
and they equal one device's (fp32). MoE layers slice every expert's intermediate dim by
default and place whole experts on ranks with expert parallelism; both give the same logits.
Checkpoints are tiny random HF models (tests/models/test_families.py's configs)."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from multiprocessing import get_context

import pytest
import torch

from asyncserve.models.moe import SparseMoE
from asyncserve.models.parallel import SINGLE, TensorParallel
from tests.models.test_families import save_tiny_family
from tests.models.tp_ranks import load, logits, rank_main

FAMILIES = (
    "mixtral",
    "qwen3_moe",
    "granitemoe",
    "granite",
    "phi3",
    "gemma3",
    "opt",
    "opt_post_norm",
)
MOE = ("mixtral", "qwen3_moe", "granitemoe")


@dataclass
class Checkpoints:
    paths: dict[str, str]
    # (family, expert_parallel) -> rank 0's logits with two ranks
    tp2: dict[tuple[str, bool], torch.Tensor]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    paths = {}
    for name in FAMILIES:
        path = tmp_path_factory.mktemp(name)
        save_tiny_family(name, path)
        paths[name] = str(path)
    jobs = [(name, paths[name], False) for name in FAMILIES]
    jobs += [(name, paths[name], True) for name in MOE]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=rank_main, args=(r, f"tcp://127.0.0.1:{port}", jobs, queue))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    tp2 = {}
    try:
        for _ in jobs:
            name, expert_parallel, logits = queue.get(timeout=120)
            tp2[(name, expert_parallel)] = logits
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    return Checkpoints(paths, tp2)


@pytest.mark.parametrize("name", FAMILIES)
def test_two_ranks_equal_one_device(checkpoints: Checkpoints, name: str) -> None:
    expected = logits(load(checkpoints.paths[name], SINGLE), SINGLE)
    got = checkpoints.tp2[(name, False)]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("name", MOE)
def test_expert_parallel_equals_sliced_experts(checkpoints: Checkpoints, name: str) -> None:
    sliced = checkpoints.tp2[(name, False)]
    whole = checkpoints.tp2[(name, True)]
    torch.testing.assert_close(whole, sliced, atol=1e-4, rtol=1e-4)
    assert torch.equal(whole.argmax(-1), sliced.argmax(-1))


@pytest.mark.parametrize("name", MOE)
def test_each_rank_holds_its_share_of_the_experts(checkpoints: Checkpoints, name: str) -> None:
    # Loading needs no process group: the shapes each rank holds, in this process.
    full = load(checkpoints.paths[name], SINGLE)
    layers = [i for i, layer in enumerate(full.model.layers) if isinstance(layer.mlp, SparseMoE)]
    assert layers
    for rank in range(2):
        for expert_parallel in (False, True):
            part = load(checkpoints.paths[name], TensorParallel(rank, 2, expert_parallel))
            for i in layers:
                want, got = full.model.layers[i].mlp, part.model.layers[i].mlp
                experts, inter = want.w2.shape[0], want.w2.shape[2]
                if expert_parallel:
                    # Whole experts, a contiguous half each.
                    half = slice(rank * experts // 2, (rank + 1) * experts // 2)
                    torch.testing.assert_close(got.w13, want.w13[half])
                    torch.testing.assert_close(got.w2, want.w2[half])
                else:
                    # Every expert, half of its intermediate dim: gate rows, then up rows.
                    rows = slice(rank * inter // 2, (rank + 1) * inter // 2)
                    gate, up = want.w13[:, :inter], want.w13[:, inter:]
                    torch.testing.assert_close(got.w13, torch.cat([gate[:, rows], up[:, rows]], 1))
                    torch.testing.assert_close(got.w2, want.w2[:, :, rows])
