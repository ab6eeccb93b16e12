"""Per-step cost of getting a step to the tensor-parallel workers: the shared-memory
broadcast (msgspec, executor/shm_broadcast.py) against pickled messages over one pipe per
worker (the transport it replaced). No model runs: each of `--ranks` worker processes
decodes the messages as the real worker loop does and answers over its pipe, so a step's
round trip is, as each executor sends it:

    pipes (before):  ("forward", plan) and ("sample", None) to each worker, one reply each
    broadcast (now): "forward", "sample" and "collect" written once, one reply each

Medians over `--steps` steps, in microseconds: `send` is the engine's step thread sending
the forward message (what delays the launch), `step` the whole round trip. Plans: a decode
step of `--batch` running requests and a prefill step of 8 new requests of 1024 tokens.

    python benchmarks/tp_broadcast.py [--ranks 2] [--batch 256] [--steps 2000] [--output-json F]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import time
from multiprocessing import get_context
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncserve.core.step import NewRequestData, RunningRequestData, StepPlan  # noqa: E402
from asyncserve.executor.shm_broadcast import (  # noqa: E402
    ReaderHandle,
    ShmBroadcast,
    ShmReader,
)
from asyncserve.executor.step_codec import (  # noqa: E402
    decode,
    encode_collect,
    encode_forward,
    encode_sample,
    encode_stop,
)
from asyncserve.sampling_params import SamplingParams  # noqa: E402


def decode_plan(batch: int) -> StepPlan:
    running = [
        RunningRequestData(f"req-{i}", [i] if i % 16 == 0 else [], 500 + i) for i in range(batch)
    ]
    return StepPlan(
        running_requests=running,
        num_scheduled_tokens={r.request_id: 1 for r in running},
        total_num_scheduled_tokens=batch,
        freed_request_ids={"req-done-1", "req-done-2"},
    )


def prefill_plan() -> StepPlan:
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=128, stop=["\n\n"])
    params.all_stop_token_ids = {0, 2}
    new = [
        NewRequestData(f"new-{i}", list(range(1000 + i, 2024 + i)), [], params, list(range(64)), 0)
        for i in range(8)
    ]
    return StepPlan(
        new_requests=new,
        num_scheduled_tokens={n.request_id: 1024 for n in new},
        total_num_scheduled_tokens=8 * 1024,
    )


def _pipe_worker(conn: Connection) -> None:
    while True:
        message = conn.recv()
        if message[0] == "stop":
            return
        if message[0] == "sample":
            conn.send(("ok", None))


def _shm_worker(handle: ReaderHandle, conn: Connection) -> None:
    reader = ShmReader(handle, conn)
    while True:
        data = reader.read()
        if data is None:
            return
        message = decode(data)
        if message[0] == "stop":
            reader.close()
            return
        if message[0] == "collect":
            conn.send(("ok", None))


def _median_us(values: list[float]) -> float:
    return round(statistics.median(values) * 1e6, 1)


def run_pipes(ranks: int, plan: StepPlan, steps: int) -> dict[str, float]:
    ctx = get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(ranks)]
    procs = [ctx.Process(target=_pipe_worker, args=(child,), daemon=True) for _, child in pipes]
    for p in procs:
        p.start()
    conns = [parent for parent, _ in pipes]
    sends, rounds = [], []
    for _ in range(steps):
        start = time.perf_counter()
        for conn in conns:  # what the pipe executor did: one pickle per worker
            conn.send(("forward", plan))
        sent = time.perf_counter()
        for conn in conns:
            conn.send(("sample", None))
        for conn in conns:
            conn.recv()
        sends.append(sent - start)
        rounds.append(time.perf_counter() - start)
    for conn in conns:
        conn.send(("stop",))
    for p in procs:
        p.join()
    return {"send_us": _median_us(sends), "step_us": _median_us(rounds)}


def run_shm(ranks: int, plan: StepPlan, steps: int) -> dict[str, float]:
    ctx = get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(ranks)]
    broadcast = ShmBroadcast(ctx, [parent for parent, _ in pipes])
    procs = [
        ctx.Process(target=_shm_worker, args=(broadcast.reader(r), child), daemon=True)
        for r, (_, child) in enumerate(pipes)
    ]
    for p in procs:
        p.start()
    conns = [parent for parent, _ in pipes]

    def ok() -> None:
        return None

    sends, rounds = [], []
    for _ in range(steps):
        start = time.perf_counter()
        broadcast.write(encode_forward(plan), ok)
        sent = time.perf_counter()
        broadcast.write(encode_sample(None), ok)
        broadcast.write(encode_collect(), ok)
        for conn in conns:
            conn.recv()
        sends.append(sent - start)
        rounds.append(time.perf_counter() - start)
    broadcast.write(encode_stop(), ok)
    for p in procs:
        p.join()
    broadcast.close()
    return {"send_us": _median_us(sends), "step_us": _median_us(rounds)}


def main() -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    report: dict[str, Any] = {"ranks": args.ranks, "steps": args.steps, "cpus": os.cpu_count()}
    plans = {f"decode-{args.batch}": decode_plan(args.batch), "prefill-8x1024": prefill_plan()}
    for name, plan in plans.items():
        sizes = {
            "pickle_bytes": len(pickle.dumps(plan)),
            "msgpack_bytes": len(encode_forward(plan)),
        }
        pipes = run_pipes(args.ranks, plan, args.steps)
        shm = run_shm(args.ranks, plan, args.steps)
        report[name] = {"pipes": pipes, "shm": shm, **sizes}
        print(
            f"{name}: pipes send {pipes['send_us']} us, step {pipes['step_us']} us | "
            f"shm send {shm['send_us']} us, step {shm['step_us']} us | "
            f"{sizes['pickle_bytes']} B pickled, {sizes['msgpack_bytes']} B msgpack"
        )
    out = args.output_json or (
        os.path.join(os.environ["OUT"], "tp_broadcast.json") if os.environ.get("OUT") else None
    )
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
