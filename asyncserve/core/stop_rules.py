"""When a request stops, as vLLM rules it: a stop token once min_tokens are out, then the
length limits (max_tokens, max_model_len)."""

from __future__ import annotations

from asyncserve.core.request import Request, RequestStatus


def check_stop(request: Request, token_id: int, max_model_len: int) -> bool:
    """Whether the request's newest token ends it; sets its status and stop reason."""
    params = request.sampling_params
    num_output = len(request.output_token_ids)
    if token_id in params.all_stop_token_ids and num_output >= params.min_tokens:
        request.status = RequestStatus.FINISHED_STOPPED
        # vLLM reports the model's own EOS as no stop reason, any other stop id as itself.
        request.stop_reason = None if token_id == request.eos_token_id else token_id
        return True
    if (
        num_output >= request.max_tokens
        or num_output + len(request.prompt_token_ids) >= max_model_len
    ):
        request.status = RequestStatus.FINISHED_LENGTH
        return True
    return False


def at_length_limit(request: Request, max_model_len: int) -> bool:
    """The tokens in flight already reach max_tokens or max_model_len: nothing more to
    compute until they are known (and the request finishes)."""
    pending = request.num_output_placeholders
    return pending > 0 and (
        request.num_output_tokens + pending >= request.max_tokens
        or request.num_tokens + pending >= max_model_len
    )
