"""Pipeline parallelism's micro-batches: up to `depth` steps in flight, with disjoint requests.

With P pipeline stages the step loop keeps P steps in flight, so that stage 0 computes step
t + 1 while stage 1 computes step t. A request's next step needs the token its last step
samples on the last stage, which stage 0 cannot have before that step returns: a request
in flight is not scheduled again until its step is back (as vLLM v1 does for pipeline
parallelism; async scheduling's placeholders do not apply here).

Only the last stage samples, so the other stages learn a request's new tokens from the plan
that next schedules it (RunningRequestData.new_token_ids). And each step takes at most
1 / P of the requests, so that the P steps in flight are of about the same size instead of
the first taking every request and the others none.
"""

from __future__ import annotations

from collections import Counter

from asyncserve.core.request import Request
from asyncserve.core.step import StepPlan


class MicroBatches:
    def __init__(self, depth: int) -> None:
        # Steps that may be in flight at once (the pipeline parallel size; 1: no pipeline).
        self.depth = depth
        # request id -> steps in flight that hold it (a request preempted in flight may be
        # admitted again before that step is back).
        self._in_flight: Counter[str] = Counter()
        # request id -> how many of its output tokens the workers were sent in plans.
        self._sent: dict[str, int] = {}

    @property
    def enabled(self) -> bool:
        return self.depth > 1

    def busy(self, request: Request) -> bool:
        """Whether the request is in a step still in flight."""
        return self.enabled and request.request_id in self._in_flight

    def max_requests(self, num_unfinished: int, max_num_seqs: int) -> int | None:
        """Requests one step may take: an equal share of the ones that can run (None: no
        cap beyond max_num_seqs)."""
        if not self.enabled:
            return None
        return max(1, -(-min(num_unfinished, max_num_seqs) // self.depth))

    def launched(self, plan: StepPlan, running: list[Request], new: list[Request]) -> None:
        """The plan goes out: its requests are in flight; each running one carries the
        output tokens the workers were not sent yet (only the last stage saw them, sampling
        them); a (re)admitted one travels with all of its own."""
        if not self.enabled:
            return
        sent = self._sent
        for data, request in zip(plan.running_requests, running, strict=True):
            start = sent.get(request.request_id, 0)
            data.new_tokens_from = start
            data.new_token_ids = request.output_token_ids[start:]
            sent[request.request_id] = len(request.output_token_ids)
        for request in new:
            sent[request.request_id] = len(request.output_token_ids)
        self._in_flight.update(list(plan.num_scheduled_tokens))  # ids, not counts

    def returned(self, plan: StepPlan) -> None:
        """The plan's step is back (its tokens are known): its requests may run again."""
        if not self.enabled:
            return
        in_flight = self._in_flight
        for request_id in plan.num_scheduled_tokens:
            in_flight[request_id] -= 1
            if in_flight[request_id] <= 0:
                del in_flight[request_id]

    def forget(self, request_id: str) -> None:
        """The request ended: the runners drop it."""
        self._sent.pop(request_id, None)
