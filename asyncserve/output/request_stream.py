"""Per-request mailbox between the step loop and the reader of `generate()`.

A single slot: when the reader falls behind, delta outputs merge into the pending one, so
a slow client never makes the step loop queue unbounded work.
"""

from __future__ import annotations

import asyncio

from asyncserve.outputs import RequestOutput
from asyncserve.sampling_params import RequestOutputKind


def merge_delta(pending: RequestOutput, new: RequestOutput) -> RequestOutput:
    """Fold `new` into `pending` (both delta outputs of the same request)."""
    by_index = {c.index: c for c in pending.outputs}
    for comp in new.outputs:
        old = by_index.get(comp.index)
        if old is None:
            by_index[comp.index] = comp
            continue
        old.text += comp.text
        old.token_ids = old.token_ids + comp.token_ids
        if comp.logprobs is not None:
            old.logprobs = (old.logprobs or []) + comp.logprobs
        old.cumulative_logprob = comp.cumulative_logprob
        old.finish_reason = comp.finish_reason
        old.stop_reason = comp.stop_reason
    pending.outputs = sorted(by_index.values(), key=lambda c: c.index)
    pending.finished = new.finished
    pending.error = new.error or pending.error
    pending.internal_error = new.internal_error or pending.internal_error
    pending.metrics = new.metrics or pending.metrics
    if new.prompt_logprobs is not None:
        pending.prompt_logprobs = new.prompt_logprobs
    return pending


class RequestStream:
    """Written by the step loop, read by one `generate()`, both on the event loop's thread.

    The reader waits on a bare future rather than an asyncio.Event: this runs once per
    request per step, hundreds of times a step when serving many streams."""

    def __init__(self, request_id: str, output_kind: RequestOutputKind) -> None:
        self.request_id = request_id
        self.output_kind = output_kind
        self._pending: RequestOutput | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.finished = False

    def put(self, output: RequestOutput) -> None:
        if self._pending is not None and self.output_kind == RequestOutputKind.DELTA:
            self._pending = merge_delta(self._pending, output)
        else:
            self._pending = output
        self.finished = output.finished
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():  # a reader cancelled while waiting left it cancelled
                waiter.set_result(None)

    async def get(self) -> RequestOutput:
        while self._pending is None:
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            await waiter
        output = self._pending
        self._pending = None
        return output
