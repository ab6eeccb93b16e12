"""worker/kv_blocks.py: whole KV blocks written into the paged pool at the given ids, the
rest of the pool untouched; blocks that do not fit are refused before anything is written."""

from __future__ import annotations

import pytest
import torch

from asyncserve.worker.kv_blocks import KVCaches, read_blocks, write_blocks, write_rank_blocks

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, DIM = 3, 8, 4, 2, 5


def make_pool(device: str = "cpu", heads: int = HEADS) -> KVCaches:
    gen = torch.Generator().manual_seed(0)
    shape = (BLOCKS, BLOCK_SIZE, heads, DIM)
    return [
        (torch.randn(shape, generator=gen).to(device), torch.randn(shape, generator=gen).to(device))
        for _ in range(LAYERS)
    ]


def wire_blocks(count: int, heads: int = HEADS, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(count, LAYERS, 2, BLOCK_SIZE, heads, DIM, generator=gen)


def snapshot(pool: KVCaches) -> list[torch.Tensor]:
    return [t.cpu().clone() for kv in pool for t in kv]


def check_written(
    pool: KVCaches, before: list[torch.Tensor], ids: list[int], data: torch.Tensor
) -> None:
    assert torch.equal(read_blocks(pool, ids), data)
    others = [b for b in range(BLOCKS) if b not in ids]
    for now, old in zip(snapshot(pool), before, strict=True):
        assert torch.equal(now[others], old[others])


def test_blocks_are_written_at_their_ids_in_order() -> None:
    pool = make_pool()
    before = snapshot(pool)
    ids = [5, 0, 3]
    data = wire_blocks(len(ids))
    write_blocks(pool, ids, data)
    check_written(pool, before, ids, data)
    # Keys and values of each layer land in their own tensors.
    assert torch.equal(pool[1][0][0], data[1, 1, 0]) and torch.equal(pool[2][1][3], data[2, 2, 1])


@pytest.mark.parametrize(
    "data",
    [
        wire_blocks(2),  # three ids, two blocks
        wire_blocks(3, heads=HEADS + 1),
        wire_blocks(3).to(torch.float16),
        wire_blocks(3)[:, :2],  # fewer layers
    ],
)
def test_blocks_that_do_not_fit_are_refused_with_nothing_written(data: torch.Tensor) -> None:
    pool = make_pool()
    before = snapshot(pool)
    with pytest.raises(ValueError, match="do not fit this pool"):
        write_blocks(pool, [1, 2, 4], data)
    for now, old in zip(snapshot(pool), before, strict=True):
        assert torch.equal(now, old)


def test_a_rank_writes_its_own_heads_or_says_why_not() -> None:
    pool = make_pool(heads=1)
    before = snapshot(pool)
    data = wire_blocks(2, heads=4)
    assert write_rank_blocks(pool, [6, 2], data, (2, 1), 4) is None
    check_written(pool, before, [6, 2], data[..., 2:3, :])
    reason = write_rank_blocks(pool, [1, 7], wire_blocks(2, heads=3), (2, 1), 4)
    assert reason is not None and "4 KV heads" in reason


@pytest.mark.parametrize("source", ["host", "host view", "side stream"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_write_does_not_wait_for_the_stream(source: str) -> None:
    """Queued behind the work already on the stream (a long kernel here), not waited for:
    from host blocks (a rank's heads are a strided view of them) or from blocks received
    on another stream."""
    pool = make_pool("cuda")
    before = snapshot(pool)
    ids = [7, 1]
    data = wire_blocks(len(ids), heads=HEADS + 1)[..., 1:, :]
    blocks = data.contiguous() if source == "host" else data
    if source == "side stream":
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            blocks = data.cuda()
        side.synchronize()  # as the KV group's host-side wait for its receive
    # Not timed: a first write may wait for the device (kernels loaded on first use, say).
    write_blocks(pool, ids, torch.zeros_like(blocks))
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of one GPU thread spinning
    busy = torch.cuda.Event()
    busy.record()
    write_blocks(pool, ids, blocks)
    assert not busy.query()
    del blocks
    torch.cuda.synchronize()
    check_written(pool, before, ids, data)
