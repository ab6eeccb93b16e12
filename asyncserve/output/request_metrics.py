"""A finished request's timings: the metrics on its last output, the engine's counters, and
its trace span."""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncserve.metrics import EngineMetrics
from asyncserve.tracing import FinishedRequest, RequestTracer

if TYPE_CHECKING:
    from asyncserve.output.output_processor import ParentState


def finish_metrics(
    parent: ParentState, now: float, metrics: EngineMetrics | None, tracer: RequestTracer | None
) -> dict[str, float]:
    """Count the request as finished (metrics, trace) and return its RequestOutput.metrics."""
    first = parent.children[0].request
    queue_s = (first.first_scheduled_time or now) - parent.arrival_time
    e2e_s = now - parent.arrival_time
    reason = parent.children[0].finish_reason or "abort"
    if metrics is not None:
        generated = sum(c.request.num_output_tokens for c in parent.children)
        metrics.on_request_finished(reason, e2e_s, queue_s, len(parent.prompt_token_ids), generated)
    out = {"e2e_s": e2e_s, "queue_s": queue_s}
    if parent.first_token_time is not None:
        out["ttft_s"] = parent.first_token_time - parent.arrival_time
    if tracer is not None:
        _trace(parent, now, tracer)
    return out


def _trace(parent: ParentState, now: float, tracer: RequestTracer) -> None:
    requests = [c.request for c in parent.children]
    scheduled = [r.first_scheduled_time for r in requests if r.first_scheduled_time]
    params = parent.params
    tracer.record(
        FinishedRequest(
            request_id=parent.request_id,
            arrival=parent.arrival_time,
            first_scheduled=min(scheduled) if scheduled else None,
            first_token=parent.first_token_time,
            finished=now,
            prompt_tokens=len(parent.prompt_token_ids),
            completion_tokens=sum(r.num_output_tokens for r in requests),
            num_sequences=len(requests),
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            model_execute_s=(
                sum(r.model_execute_time for r in requests) if tracer.detailed else None
            ),
            headers=parent.trace_headers,
        )
    )
