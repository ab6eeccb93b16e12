"""The seam between the engine process and its device workers.

The step loop plans a step (a StepPlan, plain data) and hands it to an executor; what comes
back is a future of the StepResult. A step runs in three stages so that async scheduling can
interleave them (see engine/step_loop.py):

  launch_forward(plan)          apply the plan, build inputs, enqueue the forward pass
  launch_sampling(fwd, masks)   sample (after the grammar masks arrive), start the copy back
  collect(launched)             wait for the sampled ids: the StepResult

Each stage returns a concurrent future at once; stages run in submission order on every
worker. Calls that are not steps (KV pool sizing, allocation, profiling) go to every worker
through collective_rpc.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from asyncserve.core.step import GrammarBitmask, StepPlan, StepResult

# The masks of a step's constrained rows, filled while its forward runs (None: no row is).
MasksFuture = Future[GrammarBitmask | None]


class Executor(ABC):
    """Runs StepPlans on the workers; every method returns without waiting for a device."""

    # Steps with disjoint requests that may be in flight at once: the pipeline stages
    # (each works on its own step); 1 without pipeline parallelism.
    max_concurrent_batches: int = 1

    @abstractmethod
    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call `method(*args)` on every worker's runner, in step order; one result each."""

    @abstractmethod
    def launch_forward(self, plan: StepPlan, on_launched: Callable[[], None]) -> Future[Any]:
        """Enqueue the plan's forward pass. `on_launched` is called (on any thread) once the
        forward is enqueued on the device, or the stage ended without one."""

    @abstractmethod
    def launch_sampling(self, forwarded: Future[Any], masks: MasksFuture | None) -> Future[Any]:
        """Enqueue sampling for a launched forward; waits for `masks` on the worker."""

    @abstractmethod
    def collect(self, launched: Future[Any]) -> Future[StepResult]:
        """The sampled tokens of a launched step."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers; pending stages are dropped."""

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Have `callback(reason)` called (on any thread) when the workers fail outside a
        step, e.g. a worker process dies while the engine is idle. Workers in this process
        fail only inside steps."""
        return None

    def submit_rpc(self, method: str, *args: Any) -> Future[list[Any]]:
        """collective_rpc queued behind the steps launched so far: work on the KV pool that
        must not overlap a step still in flight (disaggregated prefill's block copies)."""
        done: Future[list[Any]] = Future()
        try:
            done.set_result(self.collective_rpc(method, *args))
        except BaseException as exc:
            done.set_exception(exc)
        return done

    def execute(self, plan: StepPlan, masks: MasksFuture | None = None) -> Future[StepResult]:
        """One whole step: forward, sampling, collect."""
        forwarded = self.launch_forward(plan, lambda: None)
        return self.collect(self.launch_sampling(forwarded, masks))

    def determine_num_blocks(self, max_model_len: int) -> int:
        """KV blocks every worker can hold: the smallest of theirs."""
        return min(self.collective_rpc("determine_num_blocks", max_model_len))

    def allocate_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        self.collective_rpc("allocate_kv_cache", num_blocks, max_model_len)
