"""The scheduler's side of proposals: which of a request's proposals a step verifies."""

from __future__ import annotations

from asyncserve.core.request import Request


def take_proposals(request: Request, num_new: int, budget: int, max_model_len: int) -> list[int]:
    """The proposals to verify this step (taken off the request), cut so that the step's
    tokens (accepted proposals plus one) stay within the budget, max_tokens and
    max_model_len. Only a plain decode step (one new token, none in flight) verifies."""
    spec = request.spec_token_ids
    if not spec:
        return spec
    request.spec_token_ids = []
    if num_new != 1 or request.num_output_placeholders:
        return []
    room = min(
        budget - 1,
        request.max_tokens - request.num_output_tokens - 1,
        max_model_len - request.num_tokens - 1,
    )
    return spec[: max(room, 0)]
