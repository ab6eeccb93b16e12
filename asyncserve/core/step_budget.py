"""What one Scheduler.schedule() call has handed out so far: the token budget left, the
prefill budget left (the decode-latency cap), and the requests scheduled with their tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from asyncserve.core.request import Request


@dataclass
class StepBudget:
    """What one schedule() call has handed out so far."""

    budget: int
    # Tokens left for chunks of more than one token (prefills); None: only `budget` counts.
    prefill_budget: int | None = None
    preempted: bool = False
    # Requests this step may take (pipeline parallelism shares them among the steps in flight).
    max_requests: int | None = None
    num_scheduled: dict[str, int] = field(default_factory=dict)
    running: list[Request] = field(default_factory=list)
    new: list[Request] = field(default_factory=list)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    # request id -> proposed tokens to verify (speculative decoding), within num_scheduled.
    spec: dict[str, list[int]] = field(default_factory=dict)

    @property
    def full(self) -> bool:
        return self.max_requests is not None and len(self.num_scheduled) >= self.max_requests

    def limit(self, num_wanted: int) -> int:
        """Tokens a request wanting num_wanted gets: a decode (1) only needs the budget; a
        prefill chunk is also held to the prefill budget."""
        num_new = min(num_wanted, self.budget)
        if num_new > 1 and self.prefill_budget is not None:
            num_new = min(num_new, self.prefill_budget)
        return num_new

    def add_running(
        self, request: Request, num_new: int, block_ids: list[int], spec: Sequence[int] = ()
    ) -> None:
        self.running.append(request)
        self.new_block_ids[request.request_id] = block_ids
        if spec:
            self.spec[request.request_id] = list(spec)
        elif num_new == 1:  # a decode (most requests, every step): _take without the call
            self.num_scheduled[request.request_id] = 1
            self.budget -= 1
            return
        # A decode with proposals is not a prefill: only its own token counts as one.
        self._take(request, num_new, num_new - len(spec) > 1)

    def remove_running(self, request: Request) -> None:
        self.running.remove(request)
        num_new = self.num_scheduled.pop(request.request_id)
        spec = self.spec.pop(request.request_id, [])
        self.budget += num_new
        if num_new - len(spec) > 1 and self.prefill_budget is not None:
            self.prefill_budget += num_new
        del self.new_block_ids[request.request_id]

    def add_new(self, request: Request, num_new: int) -> None:
        self.new.append(request)
        self._take(request, num_new, num_new > 1)

    def _take(self, request: Request, num_new: int, is_prefill: bool) -> None:
        self.num_scheduled[request.request_id] = num_new
        self.budget -= num_new
        if is_prefill and self.prefill_budget is not None:
            self.prefill_budget -= num_new
