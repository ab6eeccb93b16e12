"""The messages from the engine process to its workers, as bytes (msgpack through msgspec;
pickle only for the rare calls that are not steps).

  ("forward", StepPlan)                 b"F" + msgpack
  ("sample", GrammarBitmask | None)     b"S" + msgpack (the mask's int32 words as raw bytes)
  ("collect",)                          b"C"
  ("rpc", method, args)                 b"R" + pickle
  ("stop",)                             b"X"

msgspec rebuilds a dataclass through its __post_init__, which resets the engine-filled
SamplingParams.all_stop_token_ids to the user's stop ids: the plan carries them beside
each new request and the decoder puts them back.
"""

from __future__ import annotations

import pickle
from typing import Any

import msgspec
import torch

from asyncserve.core.step import GrammarBitmask, StepPlan

Message = tuple[Any, ...]

_FORWARD, _SAMPLE, _COLLECT, _RPC, _STOP = b"F", b"S", b"C", b"R", b"X"

_WirePlan = tuple[StepPlan, list[list[int]]]
# (request ids, rows, words per row, the words' bytes)
_WireMask = tuple[list[str], int, int, bytes] | None

_encoder = msgspec.msgpack.Encoder()
_plan_decoder = msgspec.msgpack.Decoder(_WirePlan)
_mask_decoder = msgspec.msgpack.Decoder(_WireMask)


def encode_forward(plan: StepPlan) -> bytes:
    stop_ids = [sorted(new.sampling_params.all_stop_token_ids) for new in plan.new_requests]
    return _FORWARD + _encoder.encode((plan, stop_ids))


def encode_sample(bitmask: GrammarBitmask | None) -> bytes:
    if bitmask is None:
        return _SAMPLE + _encoder.encode(None)
    words = bitmask.bitmask
    rows, cols = words.shape
    raw = words.contiguous().numpy().tobytes()
    return _SAMPLE + _encoder.encode((bitmask.request_ids, rows, cols, raw))


def encode_collect() -> bytes:
    return _COLLECT


def encode_rpc(method: str, args: tuple[Any, ...]) -> bytes:
    return _RPC + pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)


def encode_stop() -> bytes:
    return _STOP


def decode(data: bytes) -> Message:
    kind, body = data[:1], memoryview(data)[1:]
    if kind == _FORWARD:
        plan, stop_ids = _plan_decoder.decode(body)
        for new, ids in zip(plan.new_requests, stop_ids, strict=True):
            new.sampling_params.all_stop_token_ids = set(ids)
        return ("forward", plan)
    if kind == _SAMPLE:
        mask = _mask_decoder.decode(body)
        if mask is None:
            return ("sample", None)
        request_ids, rows, cols, raw = mask
        if rows * cols == 0:
            words = torch.empty(rows, cols, dtype=torch.int32)
        else:
            words = torch.frombuffer(bytearray(raw), dtype=torch.int32).reshape(rows, cols)
        return ("sample", GrammarBitmask(request_ids, words))
    if kind == _COLLECT:
        return ("collect",)
    if kind == _RPC:
        method, args = pickle.loads(body)
        return ("rpc", method, args)
    if kind == _STOP:
        return ("stop",)
    raise ValueError(f"unknown worker message kind {kind!r}")
