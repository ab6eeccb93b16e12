"""Pipeline parallelism over the Ray executor: one micro-batch per stage in flight.

With P stages the step loop keeps P steps in flight (Executor.max_concurrent_batches), each
with its own requests (core/micro_batches.py). Every rank reads its messages in order; for
steps t and t + 1 every rank gets

  ("forward", t) ("sample", t) ("collect",) ("forward", t + 1) ("sample", t + 1) ("collect",)

Stage 0 computes t, starts sending its hidden states to stage 1 and answers "collect" at
once (it samples nothing), so it computes t + 1 while stage 1 computes t. The last stage's
first rank samples t and answers "collect" with the StepResult; the engine hands the
sampled tokens to the other stages in the plan that next schedules those requests, so no
stage ever waits on a later one. The hidden states travel rank to rank (torch.distributed
send / recv: gloo on CPU, NCCL on GPU), never through Ray's object store.

The step thread only sends; a second thread reads the replies in the order they were
asked for (RayExecutor._reader), so sending step t + 1 never waits for step t's replies.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from asyncserve.core.step import StepResult, driver_result


def driver_reply(launched: Future[Future[list[Any]]], driver: int) -> Future[StepResult]:
    """The StepResult of a step whose replies were asked for: `launched` resolves (on the
    step thread) to the future of every rank's reply (on the reader thread)."""
    result: Future[StepResult] = Future()

    def settle(replies: Future[list[Any]]) -> None:
        if replies.cancelled():
            result.set_exception(RuntimeError("the executor shut down before the step ended"))
            return
        exc = replies.exception()
        if exc is not None:
            result.set_exception(exc)
            return
        result.set_result(driver_result(replies.result(), driver))

    def asked(done: Future[Future[list[Any]]]) -> None:
        if done.cancelled():
            result.set_exception(RuntimeError("the executor shut down before the step ended"))
            return
        exc = done.exception()
        if exc is not None:
            result.set_exception(exc)
            return
        done.result().add_done_callback(settle)

    launched.add_done_callback(asked)
    return result
