"""One worker in the engine's own process: the model runner on one step thread.

The thread runs the stages of every step in submission order; the event loop never waits
on it except through futures. Python work on the event loop shares the GIL with this thread,
which is why the step loop waits for `on_launched` before its own work (engine/step_loop.py).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from asyncserve.core.step import StepPlan, StepResult
from asyncserve.executor.abstract import Executor, MasksFuture
from asyncserve.worker.model_runner import ForwardedStep, LaunchedStep, ModelRunner


class UniProcExecutor(Executor):
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncserve-step")

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return [getattr(self.runner, method)(*args)]

    def submit_rpc(self, method: str, *args: Any) -> Future[list[Any]]:
        return self._thread.submit(lambda: [getattr(self.runner, method)(*args)])

    def launch_forward(self, plan: StepPlan, on_launched: Callable[[], None]) -> Future[Any]:
        job = self._thread.submit(self.runner.launch_forward, plan, on_launched)
        # A stage that fails before it launches never calls on_launched: its end does.
        job.add_done_callback(lambda _: on_launched())
        return job

    def launch_sampling(self, forwarded: Future[Any], masks: MasksFuture | None) -> Future[Any]:
        return self._thread.submit(_sample, self.runner, forwarded, masks)

    def collect(self, launched: Future[Any]) -> Future[StepResult]:
        return self._thread.submit(_collect, self.runner, launched)

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)
        self.runner.release()


def _sample(
    runner: ModelRunner, forwarded: Future[ForwardedStep], masks: MasksFuture | None
) -> LaunchedStep:
    # The forward stage ran before this one on the same thread: its future is done.
    return runner.launch_sampling(forwarded.result(), masks)


def _collect(runner: ModelRunner, launched: Future[LaunchedStep]) -> StepResult:
    return runner.collect(launched.result())
