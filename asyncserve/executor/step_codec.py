"""The messages from the engine process to its workers, as bytes (msgpack through msgspec;
pickle only for the rare calls that are not steps).

  ("forward", StepPlan)                 b"F" + msgpack
  ("sample", GrammarBitmask | None)     b"S" + msgpack (the mask's int32 words as raw bytes)
  ("collect",)                          b"C"
  ("rpc", method, args)                 b"R" + pickle
  ("stop",)                             b"X"

A new request's SamplingParams (once per request, not per step) travels pickled inside
the msgpack: msgspec would rebuild it through __post_init__, validating it again and
resetting the fields the engine filled in after validation (all_stop_token_ids); pickle
restores it as it is, and faster. So do the plan's and new requests' fields past the core
ones (a LoRA adapter, speculative tokens...): pickled, and only when they are set, so a
field added to the contract travels without a change here and costs nothing when unused.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import msgspec
import torch

from asyncserve.core.step import GrammarBitmask, NewRequestData, RunningRequestData, StepPlan

Message = tuple[Any, ...]

_FORWARD, _SAMPLE, _COLLECT, _RPC, _STOP = b"F", b"S", b"C", b"R", b"X"

# (request id, prompt ids, output ids, pickled SamplingParams, block ids, computed tokens,
#  pickled extra fields or b"")
_WireNew = tuple[str, list[int], list[int], bytes, list[int], int, bytes]
# new requests, running requests, num_scheduled_tokens, total, freed ids, needs_output_tokens,
# pickled extra fields or b""
_WirePlan = tuple[
    list[_WireNew], list[RunningRequestData], dict[str, int], int, list[str], bool, bytes
]
_CORE_NEW = {"request_id", "prompt_token_ids", "output_token_ids", "sampling_params",
             "block_ids", "num_computed_tokens"}  # fmt: skip
_CORE_PLAN = {"new_requests", "running_requests", "num_scheduled_tokens",
              "total_num_scheduled_tokens", "freed_request_ids", "needs_output_tokens"}  # fmt: skip
# (request ids, rows, words per row, the words' bytes)
_WireMask = tuple[list[str], int, int, bytes] | None

_encoder = msgspec.msgpack.Encoder()
_plan_decoder = msgspec.msgpack.Decoder(_WirePlan)
_mask_decoder = msgspec.msgpack.Decoder(_WireMask)


def encode_forward(plan: StepPlan) -> bytes:
    new = [
        (
            r.request_id,
            r.prompt_token_ids,
            r.output_token_ids,
            pickle.dumps(r.sampling_params, protocol=pickle.HIGHEST_PROTOCOL),
            r.block_ids,
            r.num_computed_tokens,
            _extras(r, _CORE_NEW),
        )
        for r in plan.new_requests
    ]
    wire = (
        new,
        plan.running_requests,
        plan.num_scheduled_tokens,
        plan.total_num_scheduled_tokens,
        list(plan.freed_request_ids),
        plan.needs_output_tokens,
        _extras(plan, _CORE_PLAN),
    )
    return _FORWARD + _encoder.encode(wire)


def _extras(obj: Any, core: set[str]) -> bytes:
    """The fields past the core ones that differ from their defaults, pickled (b"": none)."""
    set_fields = {}
    for f in dataclasses.fields(obj):
        if f.name in core:
            continue
        value = getattr(obj, f.name)
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        if value != default:
            set_fields[f.name] = value
    return pickle.dumps(set_fields, protocol=pickle.HIGHEST_PROTOCOL) if set_fields else b""


def _restore(extras: bytes) -> dict[str, Any]:
    return pickle.loads(extras) if extras else {}


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
        new, running, scheduled, total, freed, needs_output_tokens, extras = _plan_decoder.decode(
            body
        )
        plan = StepPlan(
            new_requests=[
                NewRequestData(
                    rid, prompt, output, pickle.loads(params), blocks, computed, **_restore(more)
                )
                for rid, prompt, output, params, blocks, computed, more in new
            ],
            running_requests=running,
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=total,
            freed_request_ids=set(freed),
            needs_output_tokens=needs_output_tokens,
            **_restore(extras),
        )
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
