"""Structured outputs: grammars, per-request matchers and token bitmasks, on llguidance.

How a constrained request moves through the engine:

1. `AsyncEngine.add_request` calls `StructuredOutputManager.validate` before anything is
   queued: the constraint is compiled to an llguidance grammar and a matcher is built from it
   (cached by grammar text), so a bad schema, regex or grammar is a ValueError naming the
   field, e.g. "structured_outputs.json: invalid schema: ...". Each child request (n > 1)
   then gets its own deep copy of the cached matcher.
2. After `scheduler.update` the step loop calls `accept_tokens`: every matcher consumes its
   request's new output tokens. A matcher that reaches a stopped state (nothing but EOS can
   follow) ends its request with finish_reason "stop" before the next step is planned.
3. After `scheduler.schedule` the step loop calls `submit`: the bitmasks of the rows that
   sample in this step are filled on the grammar thread (llguidance drops the GIL while it
   computes a mask) while the forward thread runs the model; the runner waits for the
   future only right before sampling and applies it with
   `worker.grammar_mask.apply_grammar_bitmask`. The mask
   of a request's next token depends on the token it sampled last, so it cannot be computed
   earlier than right after the update that delivered that token.

A step without constrained requests pays nothing: `submit` returns None without allocating
or touching the thread. EOS is allowed exactly where the grammar accepts: the llguidance
tokenizer is built with the engine's EOS ids.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import tokenizers
import torch
from llguidance import LLExecutor, LLMatcher, LLParserLimits, LLTokenizer

from asyncserve.core.grammar_allowed import (
    banned_by_bad_words,
    check_allowed_start,
    rejection_message,
)
from asyncserve.core.grammar_limits import (
    MAX_SCHEMA_DEPTH,
    check_recursion,
    check_regex,
    check_schema_patterns,
    json_depth,
)
from asyncserve.core.request import Request, RequestStatus
from asyncserve.core.step import GrammarBitmask, StepPlan
from asyncserve.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

logger = logging.getLogger(__name__)

# What each StructuredOutputsParams field holds, for error messages.
_FIELD_NOUNS = {
    "json": "schema",
    "json_object": "schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}


@dataclass(frozen=True)
class CompiledGrammar:
    """A constraint as llguidance takes it: the grammar JSON and the field it came from."""

    field: str
    grammar: str


def build_ll_tokenizer(
    backend: tokenizers.Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]
) -> LLTokenizer:
    """llguidance's view of the tokenizer, `vocab_size` wide (the logits' width).

    Built from tokenizer.json (the backend serialized without padding or truncation), as
    `llguidance.hf.from_tokenizer` does. `eos_token_ids` are the tokens the grammar allows
    where it accepts: the engine passes every EOS id it stops on. 0.4-1 s for a 128k
    vocabulary, all of it under the GIL: build it once per engine, when first needed.
    """
    text = backend.to_str()
    if backend.padding is not None or backend.truncation is not None:
        plain = tokenizers.Tokenizer.from_str(text)
        plain.no_padding()
        plain.no_truncation()
        text = plain.to_str()
    eos: list[int] | None = list(eos_token_ids) or None
    return LLTokenizer(text, n_vocab=vocab_size, eos_token=eos)


def _json_schema(value: str | dict[str, Any] | bool) -> dict[str, Any] | bool:
    if isinstance(value, str):
        depth = json_depth(value)
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(
                f"structured_outputs.json: invalid schema: nested {depth} levels deep; "
                f"the limit is {MAX_SCHEMA_DEPTH}"
            )
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"structured_outputs.json: invalid schema: not JSON: {exc}") from None
    if not isinstance(value, dict | bool):
        raise ValueError(
            "structured_outputs.json: invalid schema: must be a JSON object or a boolean, "
            f"got {type(value).__name__}"
        )
    return value


def _json_options(whitespace_flexible: bool) -> JsonCompileOptions:
    return {"whitespace_flexible": whitespace_flexible}


def compile_grammar(
    params: StructuredOutputsParams, whitespace_flexible: bool = False
) -> CompiledGrammar:
    """The llguidance grammar for a constraint; nothing is validated beyond JSON syntax.

    `whitespace_flexible` lets JSON carry any whitespace between tokens (llguidance's
    default); off, JSON is compact, one space after ':' and ','. Small models given the
    freedom tend to emit whitespace until max_tokens.
    """
    if params.json is not None:
        schema = _json_schema(params.json)
        check_recursion(schema)
        check_schema_patterns(schema)
        try:
            grammar = LLMatcher.grammar_from_json_schema(
                schema if isinstance(schema, dict) else json.dumps(schema),
                defaults=_json_options(whitespace_flexible),
            )
        except (ValueError, TypeError) as exc:
            raise ValueError(f"structured_outputs.json: invalid schema: {exc}") from None
        return CompiledGrammar("json", grammar)
    if params.json_object:
        grammar = LLMatcher.grammar_from_json_schema(
            {"type": "object"}, defaults=_json_options(whitespace_flexible)
        )
        return CompiledGrammar("json_object", grammar)
    if params.regex is not None:
        check_regex(params.regex)
        return CompiledGrammar("regex", LLMatcher.grammar_from_regex(params.regex))
    if params.choice is not None:
        # One terminal (a lexer regex) with one alternative per choice: as parser rule
        # alternatives, more than 2000 choices overflow the Earley parser's row limit.
        # Lark string literals take JSON's escapes.
        lark = "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in params.choice)
        return CompiledGrammar("choice", LLMatcher.grammar_from_lark(lark))
    if params.grammar is not None:
        return CompiledGrammar("grammar", LLMatcher.grammar_from_lark(params.grammar))
    raise ValueError("structured_outputs: no constraint is set")


def _invalid(field: str, message: str) -> ValueError:
    return ValueError(f"structured_outputs.{field}: invalid {_FIELD_NOUNS[field]}: {message}")


def validate_structured_outputs(
    params: StructuredOutputsParams,
    tokenizer: LLTokenizer | None = None,
    whitespace_flexible: bool = False,
) -> None:
    """Raise ValueError naming the field when the constraint cannot be compiled.

    With a tokenizer, grammars that name special tokens are checked against it too.
    """
    compiled = compile_grammar(params, whitespace_flexible)
    error = LLMatcher.validate_grammar(compiled.grammar, tokenizer)
    if error:
        raise _invalid(compiled.field, error)


@dataclass
class _MatcherState:
    matcher: LLMatcher
    # The cached template's key (its grammar): dropped when this copy fails.
    grammar: str
    # Output tokens of the request already consumed by the matcher.
    num_consumed: int = 0


def _grammar_end(matcher: LLMatcher, tokens: list[int]) -> int | None:
    """How many of `tokens` complete the grammar when more follow them; None when the
    grammar is not complete before the last one (the matcher is left as it was)."""
    num_valid = matcher.validate_tokens(tokens[:-1]) if len(tokens) > 1 else 0
    for i in range(num_valid):
        matcher.consume_token(tokens[i])
        if matcher.is_stopped():
            return i + 1
    if num_valid:
        matcher.rollback(num_valid)
    return None


@dataclass
class AcceptResult:
    """What consuming one step's tokens did to the matchers."""

    # Requests whose grammar is complete: end them with finish_reason "stop".
    stopped: list[str]
    # (request id, message) of matchers that rejected a token.
    errored: list[tuple[str, str]]


class StructuredOutputManager:
    """Matchers of the live constrained requests and the thread that fills their masks."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        *,
        pin_memory: bool = False,
        whitespace_flexible: bool = False,
        cache_size: int = 128,
        num_threads: int | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.whitespace_flexible = whitespace_flexible
        self.pin_memory = pin_memory
        self._cache_size = cache_size
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncserve-grammar")
        # Built on first use, not at start-up: the build holds the GIL throughout (0.4-1 s
        # for a 128k vocabulary), which on a thread of its own stalled the server's start
        # by as much, and most servers never see a constrained request.
        self._tokenizer_source = (backend, vocab_size, list(eos_token_ids))
        self._tokenizer: LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()
        self._templates: OrderedDict[str, LLMatcher] = OrderedDict()
        self._templates_lock = threading.Lock()
        self._matchers: dict[str, _MatcherState] = {}
        self._buffer: torch.Tensor | None = None
        if num_threads is None:
            num_threads = min(8, (os.cpu_count() or 1) // 2)
        # Masks of a batch in parallel (llguidance's own thread pool) when cores allow.
        self._ll_executor = LLExecutor(num_threads=num_threads) if num_threads >= 2 else None

    @property
    def tokenizer(self) -> LLTokenizer:
        """llguidance's tokenizer, built by the first caller (the first constrained request's
        validation, on a preprocessing thread)."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = build_ll_tokenizer(*self._tokenizer_source)
            return self._tokenizer

    @property
    def num_requests(self) -> int:
        return len(self._matchers)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._matchers

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)

    # ---- requests ------------------------------------------------------------------------

    def validate(
        self, params: StructuredOutputsParams, allowed_token_ids: Collection[int] | None = None
    ) -> None:
        """Compile the constraint (cached); ValueError naming the field when it is invalid,
        or naming allowed_token_ids when none of them can start the constrained output."""
        check_allowed_start(self._template(params)[1], allowed_token_ids)

    def _template(self, params: StructuredOutputsParams) -> tuple[str, LLMatcher]:
        compiled = compile_grammar(params, self.whitespace_flexible)
        # validate() may run in the server's preprocessing threads: the cache is shared.
        with self._templates_lock:
            template = self._templates.get(compiled.grammar)
            if template is not None:
                self._templates.move_to_end(compiled.grammar)
                return compiled.grammar, template
        # Short errors: a rejected token's message goes to the client, without parser state.
        limits = LLParserLimits(verbose_errors=False)
        template = LLMatcher(self.tokenizer, compiled.grammar, log_level=0, limits=limits)
        if template.is_error():
            raise _invalid(compiled.field, template.get_error())
        with self._templates_lock:
            self._templates[compiled.grammar] = template
            if len(self._templates) > self._cache_size:
                self._templates.popitem(last=False)
        return compiled.grammar, template

    def add_request(self, request_id: str, params: StructuredOutputsParams) -> None:
        grammar, template = self._template(params)
        self._matchers[request_id] = _MatcherState(template.deep_copy(), grammar)

    def remove(self, request_ids: Iterable[str]) -> None:
        if not self._matchers:
            return
        for request_id in request_ids:
            self._matchers.pop(request_id, None)

    def accept_tokens(self, requests: Iterable[Request]) -> AcceptResult:
        """Advance each constrained request's matcher by its new output tokens.

        Finished requests (EOS, length) drop their matcher without consuming.
        """
        result = AcceptResult(stopped=[], errored=[])
        if not self._matchers:
            return result
        for request in requests:
            request_id = request.request_id
            state = self._matchers.get(request_id)
            if state is None:
                continue
            new_tokens = request.output_token_ids[state.num_consumed :]
            end = _grammar_end(state.matcher, new_tokens)
            if end is not None:
                # Several tokens in one step (speculative decoding) went past the grammar's
                # end (the EOS its mask forced): the output ends there, as one a step would.
                del request.output_token_ids[state.num_consumed + end :]
                if request.is_finished:  # by that EOS: released already
                    request.status = RequestStatus.FINISHED_STOPPED
                    request.stop_reason = None
                del self._matchers[request_id]
                result.stopped.append(request_id)
                continue
            if request.is_finished:
                del self._matchers[request_id]
                continue
            consumed = state.matcher.try_consume_tokens(new_tokens)
            state.num_consumed += consumed
            if consumed < len(new_tokens):
                del self._matchers[request_id]
                # Copies share the template's lazily built lexer: one that failed inside it
                # (a limit hit while computing a mask) would end the next copies at once
                # with nothing generated. The next request with this grammar compiles anew.
                with self._templates_lock:
                    self._templates.pop(state.grammar, None)
                params = request.sampling_params
                output = request.output_token_ids[: state.num_consumed]
                banned = banned_by_bad_words(params.bad_words_token_ids, output)
                message = rejection_message(
                    state.matcher,
                    new_tokens[consumed],
                    state.num_consumed,
                    params.allowed_token_ids,
                    banned,
                )
                result.errored.append((request_id, message))
            elif state.matcher.is_stopped():
                del self._matchers[request_id]
                result.stopped.append(request_id)
        return result

    # ---- masks ---------------------------------------------------------------------------

    def submit(
        self, plan: StepPlan, get_request: Callable[[str], Request | None]
    ) -> Future[GrammarBitmask] | None:
        """Start filling the masks of the constrained rows that sample in `plan`.

        Call right after `schedule()` produced `plan` (the scheduler has already counted the
        plan's tokens as computed, so a request samples when none are left to compute).
        Returns None when no row needs a mask.
        """
        if not self._matchers:
            return None
        rows: list[tuple[str, LLMatcher]] = []
        drafts: dict[str, list[int]] = {}
        for request_id in plan.num_scheduled_tokens:
            state = self._matchers.get(request_id)
            if state is None:
                continue
            request = get_request(request_id)
            if request is None or request.num_computed_tokens < request.num_tokens:
                continue  # a prompt chunk that does not reach the end samples nothing
            rows.append((request_id, state.matcher))
            spec = plan.scheduled_spec_tokens.get(request_id)
            if spec:
                drafts[request_id] = spec
        if not rows:
            return None
        if drafts:
            return self._executor.submit(self.fill_with_drafts, rows, drafts)
        return self._executor.submit(self.fill, rows)

    def fill_with_drafts(
        self, rows: Sequence[tuple[str, LLMatcher]], drafts: dict[str, list[int]]
    ) -> GrammarBitmask:
        """Masks for a step that verifies proposals: a request with k of them gets k + 1
        rows, the mask after each proposed prefix (the matcher advances over the proposals
        and rolls back). Past the first proposal the grammar rejects, the rows allow every
        token: that proposal's own row rules it out, so nothing after it is kept."""
        num_rows = sum(len(drafts.get(rid, ())) + 1 for rid, _ in rows)
        bitmask = self._rows(num_rows)
        row_bytes = bitmask.shape[1] * 4
        request_ids: list[str] = []
        row = 0
        for request_id, matcher in rows:
            spec = drafts.get(request_id, [])
            num_valid = matcher.validate_tokens(spec) if spec else 0
            for j in range(len(spec) + 1):
                if j <= num_valid:
                    if j:
                        matcher.consume_token(spec[j - 1])
                    matcher.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), row_bytes)
                else:
                    bitmask[row].fill_(-1)
                request_ids.append(request_id)
                row += 1
            if num_valid:
                matcher.rollback(num_valid)
        return GrammarBitmask(request_ids, bitmask)

    def fill(self, rows: Sequence[tuple[str, LLMatcher]]) -> GrammarBitmask:
        """Fill one mask row per (request id, matcher); runs on the grammar thread.

        The host buffer is reused from step to step: the runner is done with a step's mask
        (its copy to the device included) before the step's result comes back, and the
        next fill starts only after that.
        """
        bitmask = self._rows(len(rows))
        # llguidance writes each row straight into the (contiguous, int32) host buffer.
        row_bytes = bitmask.shape[1] * 4
        if self._ll_executor is not None and len(rows) > 1:
            pairs = [(matcher, i) for i, (_, matcher) in enumerate(rows)]
            self._ll_executor.unsafe_compute_mask_ptr(
                pairs, bitmask.data_ptr(), row_bytes, len(rows)
            )
        else:
            for i, (_, matcher) in enumerate(rows):
                matcher.unsafe_compute_mask_ptr(bitmask[i].data_ptr(), row_bytes)
        return GrammarBitmask([request_id for request_id, _ in rows], bitmask)

    def _rows(self, num_rows: int) -> torch.Tensor:
        buffer = self._buffer
        if buffer is None or buffer.shape[0] < num_rows:
            capacity = max(num_rows, 2 * buffer.shape[0] if buffer is not None else 64)
            width = (self.vocab_size + 31) // 32  # one bit per token in int32 words
            buffer = torch.empty((capacity, width), dtype=torch.int32, pin_memory=self.pin_memory)
            self._buffer = buffer
        return buffer[:num_rows]
