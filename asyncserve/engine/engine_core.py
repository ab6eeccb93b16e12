"""The engine process's request bookkeeping: scheduler, grammar matchers, outputs, metrics.

`finish` is the one place a request is ended from outside a step (abort, error, stop string,
completed grammar, a request that can never fit, a dead engine): it frees the request's
blocks, drops its matcher, publishes its last output and counts it in the metrics. Requests
that end inside a step (EOS, length) are ended by `Scheduler.update` and published by the
output processor in the same `publish` call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from asyncserve.core.grammar import StructuredOutputManager
from asyncserve.core.request import Request, RequestStatus
from asyncserve.core.scheduler import Scheduler
from asyncserve.core.step import StepPlan, StepResult
from asyncserve.metrics import EngineMetrics
from asyncserve.output.output_processor import OutputProcessor, ParentState
from asyncserve.spec_decode.stats import SpecDecodeStats


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        structured: StructuredOutputManager,
        output_processor: OutputProcessor,
        metrics: EngineMetrics | None,
    ) -> None:
        self.scheduler = scheduler
        self.structured = structured
        self.output_processor = output_processor
        self.metrics = metrics
        # Set while no request is live (a draining shutdown waits for it).
        self.idle = asyncio.Event()
        self.idle.set()
        # Scheduler counters already reported to metrics.
        self._seen_preemptions = 0
        self._seen_queries = 0
        self._seen_hits = 0
        self._seen_spec = SpecDecodeStats()
        # lora_int_id -> why the runner could not read the adapter: refused at admission
        # until it is loaded again (AsyncEngine.add_lora).
        self.broken_loras: dict[int, str] = {}

    # ---- requests in and out ---------------------------------------------------------------

    def add(self, parent: ParentState, requests: list[Request]) -> None:
        constraint = parent.params.structured_outputs
        if constraint is not None:
            for request in requests:
                self.structured.add_request(request.request_id, constraint)
        self.output_processor.add(parent, requests)
        for request in requests:
            self.scheduler.add_request(request)
        self.idle.clear()

    def finish(
        self, child_ids: Iterable[str], status: RequestStatus, error: str | None = None
    ) -> None:
        """End these samples (request ids as the scheduler knows them). An error ends every
        sample of the same request: a request has one error."""
        ids = list(child_ids)
        if status == RequestStatus.FINISHED_ERROR:
            ids = self.output_processor.siblings(ids) or ids
        if not ids:
            return
        self.scheduler.finish_requests(ids, status)
        self.structured.remove(ids)
        self.output_processor.finish(ids, status.finish_reason or "abort", error)
        self._check_idle()

    def abort(self, request_id: str) -> bool:
        """Abort a request by the id it was added with; False when it is not live."""
        child_ids = self.output_processor.child_ids(request_id)
        self.finish(child_ids, RequestStatus.FINISHED_ABORTED)
        return bool(child_ids)

    def fail_all(self, error: str) -> None:
        """The engine cannot go on: every live request ends with `error`."""
        for request_id in list(self.output_processor.parents):
            self.finish(
                self.output_processor.child_ids(request_id), RequestStatus.FINISHED_ERROR, error
            )

    @property
    def num_live_requests(self) -> int:
        return len(self.output_processor.parents)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- one step --------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        plan = self.scheduler.schedule()
        for request in self.scheduler.take_errored():
            self.finish([request.request_id], RequestStatus.FINISHED_ERROR, request.error)
        return plan

    def update(self, plan: StepPlan, result: StepResult) -> tuple[list[Request], list[str]]:
        """Take a step's tokens: the scheduler's stop rules, then the grammar matchers (the
        next step's masks depend on these tokens). Returns the requests that got tokens and
        the ids whose grammar completed ("stop"; their last token is text)."""
        if result.failed_requests:
            self._fail_unreadable(result)
        updated = self.scheduler.update(plan, result)
        self._record_step(plan.total_num_scheduled_tokens)
        return updated, self._advance_grammars(updated)

    def _fail_unreadable(self, result: StepResult) -> None:
        """Requests whose rows ran without their adapter (a rank could not read it): their
        outputs are void, they end with the reason, and the adapter is refused until it is
        loaded again (its cached weights go: a rank may hold a copy the others lack)."""
        failed = result.failed_requests
        for outputs in (result.sampled_token_ids, result.logprobs, result.prompt_logprobs,
                        result.draft_token_ids):  # fmt: skip
            for request_id in failed:
                outputs.pop(request_id, None)
        for request_id, reason in failed.items():
            request = self.scheduler.get_request(request_id)
            if request is None or request.is_finished:
                continue
            lora = request.lora_request
            if lora is not None and lora.lora_int_id not in self.broken_loras:
                self.broken_loras[lora.lora_int_id] = reason
                self.scheduler.remove_lora(lora.lora_int_id)
            # Its K/V were written without the adapter: none of its blocks may stay cached.
            request.num_computed_tokens = 0
            self.finish([request_id], RequestStatus.FINISHED_ERROR, reason)

    def publish(self, updated: list[Request], result: StepResult, grammar_done: list[str]) -> None:
        """Detokenize and publish a step's tokens; end what a stop string or a failure ended."""
        processed = self.output_processor.process(updated, result, grammar_done)
        if processed.stopped:
            self.finish(processed.stopped, RequestStatus.FINISHED_STOPPED)
        if processed.failed:
            self.finish(processed.failed, RequestStatus.FINISHED_ERROR)
        self._check_idle()

    def _check_idle(self) -> None:
        if not self.output_processor.parents:
            self.idle.set()

    def _advance_grammars(self, updated: list[Request]) -> list[str]:
        if not self.structured.num_requests:
            return []
        accepted = self.structured.accept_tokens(updated)
        if accepted.stopped:
            # Ended in the scheduler now; their outputs go out with this step's publish.
            self.scheduler.finish_requests(accepted.stopped, RequestStatus.FINISHED_STOPPED)
            self.structured.remove(accepted.stopped)
        for request_id, error in accepted.errored:
            self.finish([request_id], RequestStatus.FINISHED_ERROR, error)
        return accepted.stopped

    def _record_step(self, num_tokens: int) -> None:
        if self.metrics is None:
            return
        s = self.scheduler
        self.metrics.on_step(s.num_running, s.num_waiting, s.kv_cache_usage)
        if s.max_loras:
            self.metrics.on_lora(s.max_loras, *s.lora_names())
        self.metrics.on_iteration(num_tokens)
        preemptions = s.num_preemptions_total - self._seen_preemptions
        if preemptions:
            self.metrics.on_preemptions(preemptions)
        self._seen_preemptions = s.num_preemptions_total
        queries = s.prefix_cache_queries - self._seen_queries
        hits = s.prefix_cache_hits - self._seen_hits
        if queries:
            self.metrics.on_prefix_cache(queries, hits)
        self._seen_queries = s.prefix_cache_queries
        self._seen_hits = s.prefix_cache_hits
        spec, seen = s.spec_stats, self._seen_spec
        if spec.num_drafts != seen.num_drafts:
            per_pos = spec.num_accepted_tokens_per_pos
            seen_per_pos = seen.num_accepted_tokens_per_pos
            self.metrics.on_spec_decode(
                spec.num_drafts - seen.num_drafts,
                spec.num_draft_tokens - seen.num_draft_tokens,
                spec.num_accepted_tokens - seen.num_accepted_tokens,
                [
                    c - (seen_per_pos[i] if i < len(seen_per_pos) else 0)
                    for i, c in enumerate(per_pos)
                ],
            )
            self._seen_spec = SpecDecodeStats(
                spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens, list(per_pos)
            )
