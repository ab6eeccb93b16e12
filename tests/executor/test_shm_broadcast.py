"""The shared-memory broadcast and the step codec: every reader gets every message in order,
oversize messages go over the pipe, a full ring waits (and gives up on a dead reader), and a
StepPlan survives the round trip field for field."""

from __future__ import annotations

import os
import signal
import threading
import time
from multiprocessing import get_context

import pytest
import torch

from asyncserve.core.step import GrammarBitmask, NewRequestData, RunningRequestData, StepPlan
from asyncserve.executor.shm_broadcast import ShmBroadcast, ShmReader
from asyncserve.executor.step_codec import (
    decode,
    encode_collect,
    encode_forward,
    encode_rpc,
    encode_sample,
    encode_stop,
)
from asyncserve.sampling_params import SamplingParams, StructuredOutputsParams
from tests.executor.shm_orphan import middle_process


def _ok() -> None:
    return None


def _read_all(reader: ShmReader, count: int, into: list[bytes | None]) -> None:
    for _ in range(count):
        into.append(reader.read())


def test_every_reader_gets_every_message_in_order() -> None:
    ctx = get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(2)]
    writer = ShmBroadcast(ctx, [p for p, _ in pipes], num_slots=2, slot_bytes=64)
    readers = [ShmReader(writer.reader(r), pipes[r][1]) for r in range(2)]
    # More messages than slots (the writer waits for the readers), and some too large for
    # a slot (they go over each reader's pipe, larger than its buffer).
    messages = [bytes([i]) * (i * 7) for i in range(12)] + [b"x" * 1_000_000, b"", b"end"]
    got: list[list[bytes | None]] = [[], []]
    threads = [
        threading.Thread(target=_read_all, args=(readers[r], len(messages), got[r]))
        for r in range(2)
    ]
    for t in threads:
        t.start()
    for message in messages:
        writer.write(message, _ok)
    for t in threads:
        t.join(10)
    assert got == [messages, messages]
    for reader in readers:
        reader.close()
    writer.close()


def test_a_full_ring_waits_then_gives_up() -> None:
    ctx = get_context("spawn")
    parent, child = ctx.Pipe()
    writer = ShmBroadcast(ctx, [parent], num_slots=2, slot_bytes=64)
    writer.write(b"a", _ok)
    writer.write(b"b", _ok)
    with pytest.raises(TimeoutError):
        writer.write(b"c", _ok, timeout=0.05)

    def dead() -> None:
        raise RuntimeError("reader 0 died")

    # Without a timeout, the check (a dead reader) ends the wait.
    with pytest.raises(RuntimeError, match="reader 0 died"):
        writer.write(b"c", dead)
    reader = ShmReader(writer.reader(0), child)
    assert reader.read() == b"a"
    writer.write(b"c", _ok)  # a slot is free again
    assert [reader.read(), reader.read()] == [b"b", b"c"]
    reader.close()
    writer.close()


def test_a_write_that_gives_up_takes_no_slot() -> None:
    # Reader 0 keeps up, reader 1 does not: the failed write must not use up reader 0's slot.
    ctx = get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(2)]
    writer = ShmBroadcast(ctx, [p for p, _ in pipes], num_slots=1, slot_bytes=64)
    readers = [ShmReader(writer.reader(r), pipes[r][1]) for r in range(2)]
    writer.write(b"a", _ok)
    assert readers[0].read() == b"a"
    with pytest.raises(TimeoutError):
        writer.write(b"b", _ok, timeout=0.05)
    assert readers[1].read() == b"a"
    writer.write(b"b", _ok, timeout=1.0)
    assert [readers[0].read(), readers[1].read()] == [b"b", b"b"]
    for reader in readers:
        reader.close()
    writer.close()


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # exited, not yet reaped
    except FileNotFoundError:
        return True


def test_a_reader_whose_engine_was_killed_exits() -> None:
    # The reader's parent stands for the engine process: SIGKILL leaves no time to say stop.
    ctx = get_context("spawn")
    parent, child = ctx.Pipe()
    writer = ShmBroadcast(ctx, [parent])
    pids = ctx.Queue()
    middle = ctx.Process(target=middle_process, args=(writer.reader(0), child, pids))
    middle.start()
    reader_pid = pids.get(timeout=60)
    writer.write(b"step", _ok)
    os.kill(middle.pid, signal.SIGKILL)  # type: ignore[arg-type]
    middle.join()
    deadline = time.monotonic() + 10
    while not _gone(reader_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(reader_pid)
    writer.close()


def test_step_plan_round_trip() -> None:
    params = SamplingParams(
        temperature=0.7,
        top_k=5,
        seed=3,
        stop=["x"],
        stop_token_ids=[9],
        logprobs=2,
        repetition_penalty=1.2,
        bad_words=["ab"],
        structured_outputs=StructuredOutputsParams(json={"type": "object"}),
    )
    # Filled by the engine after validation: the decoder must not lose them.
    params.all_stop_token_ids = {9, 2, 0}
    params.bad_words_token_ids = [[4, 5]]
    plan = StepPlan(
        new_requests=[NewRequestData("a", [1, 2, 3], [7], params, [0, 4], 2)],
        running_requests=[RunningRequestData("b", [5], 11)],
        num_scheduled_tokens={"a": 1, "b": 1},
        total_num_scheduled_tokens=2,
        freed_request_ids={"c", "d"},
        needs_output_tokens=True,
    )
    kind, got = decode(encode_forward(plan))
    assert kind == "forward"
    assert got == plan
    assert got.new_requests[0].sampling_params.all_stop_token_ids == {9, 2, 0}
    assert list(got.num_scheduled_tokens) == ["a", "b"]  # the batch order


def test_other_messages_round_trip() -> None:
    words = torch.tensor([[1, -1, 7], [0, 2**31 - 1, -(2**31)]], dtype=torch.int32)
    kind, mask = decode(encode_sample(GrammarBitmask(["a", "b"], words)))
    assert kind == "sample" and mask.request_ids == ["a", "b"]
    assert torch.equal(mask.bitmask, words)
    empty = torch.empty(0, 3, dtype=torch.int32)
    assert decode(encode_sample(GrammarBitmask([], empty)))[1].bitmask.shape == (0, 3)
    assert decode(encode_sample(None)) == ("sample", None)
    assert decode(encode_rpc("allocate_kv_cache", (12, 64))) == (
        "rpc",
        "allocate_kv_cache",
        (12, 64),
    )
    assert decode(encode_collect()) == ("collect",)
    assert decode(encode_stop()) == ("stop",)
    with pytest.raises(ValueError, match="unknown worker message"):
        decode(b"?")
