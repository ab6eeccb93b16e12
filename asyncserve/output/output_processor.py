"""Turns sampled tokens into RequestOutputs: detokenize, stop strings, logprobs, n > 1 fan-in.

Runs on the event-loop thread while the device computes the next step.

A final-only request that needs nothing from its tokens before it ends (no stop strings, no
logprobs, no grammar, no metrics to observe per token: offline `LLM.generate`) is deferred:
the scheduler leaves it out of a step's updated requests until it finishes
(Request.tokens_read_at_end), and then its tokens are detokenized in one go (the same
incremental decode, so the same text).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from asyncserve.core.request import Request, RequestStatus
from asyncserve.core.step import StepResult
from asyncserve.metrics import EngineMetrics
from asyncserve.output.detokenizer import IncrementalDetokenizer, decode_token
from asyncserve.output.request_metrics import finish_metrics
from asyncserve.output.request_stream import RequestStream
from asyncserve.outputs import CompletionOutput, Logprob, LogprobsDict, RequestOutput
from asyncserve.sampling_params import RequestOutputKind, SamplingParams
from asyncserve.tokenizer import Tokenizer
from asyncserve.tracing import RequestTracer

logger = logging.getLogger(__name__)

# The step result of a catch-up outside a step: nothing but the request's own tokens.
_NO_RESULT = StepResult()


@dataclass
class ChildState:
    """One sample (of n) of a request."""

    index: int
    request: Request
    detokenizer: IncrementalDetokenizer | None  # None: detokenize=False, no text
    logprobs: list[LogprobsDict] | None
    cumulative_logprob: float | None
    num_sent_tokens: int = 0
    num_sent_logprobs: int = 0
    # Its finish went out already (in delta mode it is never sent again).
    sent_finish: bool = False
    # Output tokens accepted into the text (a stop string may end it early).
    num_accepted_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    last_token_time: float | None = None


@dataclass
class ProcessedStep:
    """What publishing a step ended: requests stopped by a stop string, and requests whose
    output processing failed; the scheduler frees both."""

    stopped: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: RequestStream
    children: list[ChildState] = field(default_factory=list)
    prompt_logprobs: list[LogprobsDict | None] | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    error: str | None = None
    # The error is a fault of the server, not of the request.
    internal_error: bool = False
    # W3C trace context of the HTTP request (only kept when tracing is on).
    trace_headers: Mapping[str, str] | None = None
    # Its samples' tokens are taken only when they end (see the module's docstring).
    deferred: bool = False

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)


class OutputProcessor:
    def __init__(
        self,
        tokenizer: Tokenizer,
        stream_interval: int,
        metrics: EngineMetrics | None,
        tracer: RequestTracer | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.stream_interval = max(1, stream_interval)
        self.metrics = metrics
        self.tracer = tracer
        self.parents: dict[str, ParentState] = {}
        # child request id -> (parent, child)
        self.children: dict[str, tuple[ParentState, ChildState]] = {}
        # Single-token decodes, shared by every request's detokenizer.
        self._token_texts: dict[int, str] = {}

    def add(self, parent: ParentState, requests: list[Request]) -> None:
        self.parents[parent.request_id] = parent
        parent.deferred = self._can_defer(parent.params)
        for index, request in enumerate(requests):
            params = request.sampling_params
            child = ChildState(
                index=index,
                request=request,
                detokenizer=(
                    IncrementalDetokenizer(
                        self.tokenizer.backend,
                        request.prompt_token_ids,
                        params,
                        self.tokenizer.special_token_ids,
                        self._token_texts,
                    )
                    if params.detokenize
                    else None
                ),
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )
            parent.children.append(child)
            self.children[request.request_id] = (parent, child)
            request.tokens_read_at_end = parent.deferred

    def _can_defer(self, params: SamplingParams) -> bool:
        """Nothing reads the request's tokens before it ends: no output until then, no stop
        string to look for, no per-step logprobs and no per-token metrics."""
        return (
            params.output_kind is RequestOutputKind.FINAL_ONLY
            and not params.stop
            and params.logprobs is None
            and params.structured_outputs is None  # its matcher takes every step's tokens
            and self.metrics is None
        )

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return [c.request.request_id for c in parent.children] if parent else []

    def process(
        self, updated: list[Request], result: StepResult, grammar_done: Collection[str] = ()
    ) -> ProcessedStep:
        """Publish outputs for the requests that got tokens.

        `grammar_done`: requests stopped because their grammar is complete; their last token
        is text, not a stop token. A request whose output cannot be processed (a bug, never
        the engine's state) fails alone: it ends with finish_reason "error" and its ids come
        back in `failed` for the scheduler to free; the other requests go on.
        """
        now = time.monotonic()
        processed = ProcessedStep()
        touched: dict[str, ParentState] = {}
        num_generated = 0
        # Prompt logprobs come chunk by chunk, also in steps where the request samples
        # nothing (a prompt chunk short of its end).
        for request_id, (first, entries) in result.prompt_logprobs.items():
            entry = self.children.get(request_id)
            if entry is None:
                continue
            try:
                self._append_prompt_logprobs(entry[0], first, entries)
            except Exception as exc:
                self._fail_internal(entry[0], exc, processed)
        children = self.children
        final_only = RequestOutputKind.FINAL_ONLY
        for request in updated:
            entry = children.get(request.request_id)
            if entry is None:
                continue
            parent, child = entry
            if child.finish_reason is not None:
                continue  # already ended by a stop string; later tokens are discarded
            try:
                num_generated += self._process_child(
                    parent, child, request, result, grammar_done, now, processed
                )
            except Exception as exc:
                self._fail_internal(parent, exc, processed)
                touched.pop(parent.request_id, None)
                continue
            # A final-only request has nothing to publish before one of its samples ends.
            if child.finish_reason is not None or parent.params.output_kind is not final_only:
                touched[parent.request_id] = parent
        if self.metrics is not None and num_generated:
            self.metrics.on_tokens(0, num_generated)
        for parent in touched.values():
            if parent.request_id not in self.parents:
                continue  # failed by a sibling's error above
            try:
                self._publish(parent, now)
            except Exception as exc:
                self._fail_internal(parent, exc, processed)
        return processed

    def _process_child(
        self,
        parent: ParentState,
        child: ChildState,
        request: Request,
        result: StepResult,
        grammar_done: Collection[str],
        now: float,
        processed: ProcessedStep,
    ) -> int:
        """Take one sample's new tokens into its text; returns how many there were."""
        new_tokens = request.output_token_ids[child.num_accepted_tokens :]
        if parent.deferred and parent.first_token_time is None:
            parent.first_token_time = request.first_token_time  # when the scheduler took it
        self._record_timing(parent, child, now, len(new_tokens))
        if child.logprobs is not None:
            self._append_logprobs(child, result, request.request_id)
        stop_terminated = (
            request.status is RequestStatus.FINISHED_STOPPED
            and request.request_id not in grammar_done
        )
        detokenizer = child.detokenizer
        if detokenizer is None:
            stop_str = None  # no text: stop strings are refused with detokenize=False
        elif len(new_tokens) > 1 and detokenizer.has_stop_strings:
            # Several tokens in one step (speculative decoding): the output ends with the
            # token that completes a stop string, as it would one token a step.
            stop_str = None
            for i, token in enumerate(new_tokens):
                last = i == len(new_tokens) - 1
                stop_str = detokenizer.update([token], stop_terminated and last)
                if stop_str is not None:
                    new_tokens = new_tokens[: i + 1]
                    break
        else:
            stop_str = detokenizer.update(new_tokens, stop_terminated)
        child.num_accepted_tokens += len(new_tokens)
        if stop_str is not None:
            child.finish_reason = "stop"
            child.stop_reason = stop_str
            processed.stopped.append(request.request_id)
        elif request.is_finished:
            child.finish_reason = request.status.finish_reason
            child.stop_reason = request.stop_reason
        return len(new_tokens)

    def _fail_internal(self, parent: ParentState, exc: Exception, processed: ProcessedStep) -> None:
        """End `parent` with an error after its output processing raised."""
        logger.exception("processing the output of request %s failed", parent.request_id)
        error = (
            f"internal error while processing this request's output: {type(exc).__name__}: {exc}"
        )
        processed.failed.extend(
            c.request.request_id for c in parent.children if not c.request.is_finished
        )
        for child in parent.children:
            if child.finish_reason is None:
                child.finish_reason = "error"
        parent.error = error
        parent.internal_error = True
        self._publish_failed(parent, time.monotonic())

    def siblings(self, child_ids: list[str]) -> list[str]:
        """Every sample of the requests these samples belong to."""
        out: list[str] = []
        for parent_id in dict.fromkeys(self.children[c][0].request_id for c in child_ids
                                       if c in self.children):  # fmt: skip
            out.extend(self.child_ids(parent_id))
        return out

    def finish(self, child_ids: list[str], reason: str, error: str | None = None) -> None:
        """End these samples from outside the step (abort, error, grammar end) and publish
        each request whose samples have all ended. Samples already ended keep their reason."""
        touched: dict[str, ParentState] = {}
        now = time.monotonic()
        for child_id in child_ids:
            entry = self.children.get(child_id)
            if entry is None:
                continue
            parent, child = entry
            if parent.deferred and child.finish_reason is None:
                # Its output so far goes out: take the tokens it holds now.
                try:
                    self._process_child(
                        parent, child, child.request, _NO_RESULT, (), now, ProcessedStep()
                    )
                except Exception:
                    logger.exception("processing the output of request %s failed", child_id)
            if child.finish_reason is None:
                child.finish_reason = reason
            if error is not None and parent.error is None:
                parent.error = error
            touched[parent.request_id] = parent
        for parent in touched.values():
            if not parent.finished:
                continue
            try:
                self._publish(parent, now, force=True)
            except Exception:
                logger.exception("publishing the end of request %s failed", parent.request_id)
                self._publish_failed(parent, now)

    # ---- internals -----------------------------------------------------------------------

    def _record_timing(self, parent: ParentState, child: ChildState, now: float, n: int) -> None:
        if n == 0:
            return
        if parent.first_token_time is None:
            parent.first_token_time = now
            if self.metrics is not None:
                self.metrics.on_first_token(now - parent.arrival_time)
                self.metrics.on_tokens(len(parent.prompt_token_ids), 0)
        elif child.last_token_time is not None and self.metrics is not None:
            self.metrics.on_inter_token((now - child.last_token_time) / n)
        child.last_token_time = now

    def _append_logprobs(self, child: ChildState, result: StepResult, rid: str) -> None:
        if child.logprobs is None or rid not in result.logprobs:
            return
        detokenize = child.detokenizer is not None
        for (entry, rank), token in zip(
            result.logprobs[rid],
            child.request.output_token_ids[child.num_accepted_tokens :],
            strict=False,
        ):
            child.logprobs.append(self._to_logprobs(entry, token, rank, detokenize))
            if child.cumulative_logprob is not None:
                child.cumulative_logprob += entry.get(token, 0.0)

    def _append_prompt_logprobs(
        self, parent: ParentState, first: int, entries: list[tuple[dict[int, float], int]]
    ) -> None:
        """Take the entries scoring prompt tokens first, first + 1, ... Positions already
        taken are skipped: after a preemption the request's prompt is computed, and scored,
        again from its start."""
        if parent.prompt_logprobs is None:
            parent.prompt_logprobs = [None]
        rows = parent.prompt_logprobs
        if first > len(rows):
            raise ValueError(f"prompt logprobs from position {first}, only {len(rows)} known")
        for position in range(len(rows), first + len(entries)):
            entry, rank = entries[position - first]
            token = parent.prompt_token_ids[position]
            rows.append(self._to_logprobs(entry, token, rank, parent.params.detokenize))

    def _to_logprobs(
        self, entry: dict[int, float], token: int, rank: int, detokenize: bool
    ) -> LogprobsDict:
        """One position's top logprobs; without detokenize their decoded_token is None."""
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])
        out: LogprobsDict = {}
        backend = self.tokenizer.backend
        for position, (tid, value) in enumerate(ranked, start=1):
            out[tid] = Logprob(
                logprob=value,
                rank=rank if tid == token else position,
                decoded_token=decode_token(backend, tid) if detokenize else None,
            )
        return out

    def _publish(self, parent: ParentState, now: float, force: bool = False) -> None:
        kind = parent.params.output_kind
        finished = parent.finished
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return
        delta = kind == RequestOutputKind.DELTA
        completions: list[CompletionOutput] = []
        for child in parent.children:
            done = child.finish_reason is not None
            if delta and child.sent_finish:
                continue
            pending = child.num_accepted_tokens - child.num_sent_tokens
            if delta and not done and not force and pending < self.stream_interval:
                continue
            detokenizer = child.detokenizer
            text = detokenizer.get_next_output_text(done, delta) if detokenizer else ""
            logprobs = child.logprobs
            # One copy of the tokens to send (not the whole output each step).
            first_token = child.num_sent_tokens if delta else 0
            token_ids = child.request.output_token_ids[first_token : child.num_accepted_tokens]
            if delta:
                if logprobs is not None:
                    logprobs = logprobs[child.num_sent_logprobs :]
                if not text and not token_ids and not done:
                    continue
            child.num_sent_tokens = child.num_accepted_tokens
            child.num_sent_logprobs = len(child.logprobs or [])
            child.sent_finish = done
            completions.append(
                CompletionOutput(
                    index=child.index,
                    text=text,
                    token_ids=token_ids,
                    cumulative_logprob=child.cumulative_logprob,
                    logprobs=list(logprobs) if logprobs is not None else None,
                    finish_reason=child.finish_reason,
                    stop_reason=child.stop_reason,
                )
            )
        if not completions and not finished:
            return
        first = parent.children[0].request
        output = RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=finished,
            prompt_logprobs=parent.prompt_logprobs,
            num_cached_tokens=max(first.num_cached_tokens, 0),
            error=parent.error,
            internal_error=parent.internal_error,
        )
        if finished:
            output.metrics = self._finish_metrics(parent, now)
            self._forget(parent)
        parent.stream.put(output)

    def _publish_failed(self, parent: ParentState, now: float) -> None:
        """The last output of a request that ended in error, built without the detokenizer
        or logprobs (they may be what failed)."""
        output = RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index=c.index, text="", token_ids=[], finish_reason=c.finish_reason or "error"
                )
                for c in parent.children
            ],
            finished=True,
            error=parent.error,
            internal_error=parent.internal_error,
        )
        output.metrics = self._finish_metrics(parent, now)
        self._forget(parent)
        parent.stream.put(output)

    def _finish_metrics(self, parent: ParentState, now: float) -> dict[str, float]:
        return finish_metrics(parent, now, self.metrics, self.tracer)

    def _forget(self, parent: ParentState) -> None:
        self.parents.pop(parent.request_id, None)
        for child in parent.children:
            self.children.pop(child.request.request_id, None)
