"""Incremental detokenization with stop strings, and token display for logprobs.

Text is decoded a token at a time with the prefix/read offset scheme of HF TGI and vLLM: a
short window of already-emitted tokens is decoded with and without the new ones, and only
the difference is new text. That keeps the context-dependent parts of decoding (leading
spaces, byte-level merges) right, and a multi-byte character split over several tokens is
held back until it is complete instead of coming out as U+FFFD.

Added tokens (special ones included) decode as their own segment, as HF's slow decode does:
with spaces_between_special_tokens the segments are joined by a space, otherwise by nothing.
"""

from __future__ import annotations

from tokenizers import Tokenizer

from asyncserve.sampling_params import SamplingParams

# Prompt tokens kept as decoding context for the first output tokens.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


def decode_token(tokenizer: Tokenizer, token_id: int) -> str:
    """One token's text for logprob display; special tokens show as themselves."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a request's output tokens into text as they arrive, and finds stop strings."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        params: SamplingParams,
        special_token_ids: set[int],
        token_texts: dict[int, str] | None = None,
    ) -> None:
        """`token_texts`: a cache of single-token decodes, shared by the detokenizers of one
        tokenizer (a decode step's prefix window is most often the one token before)."""
        self._tokenizer = tokenizer
        self._token_texts = token_texts if token_texts is not None else {}
        self._skip_special = params.skip_special_tokens
        self._separator = " " if params.spaces_between_special_tokens else ""
        self._special_ids = special_token_ids
        added = {tid: tok.content for tid, tok in tokenizer.get_added_tokens_decoder().items()}
        for tid in special_token_ids:
            added.setdefault(tid, tokenizer.decode([tid], skip_special_tokens=False))
        self._added = added
        assert isinstance(params.stop, list)  # SamplingParams normalises it
        self._stop = list(params.stop)
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        # While streaming, a partial stop string at the end of the text must not go out yet.
        self._hold_back = (
            max(len(s) for s in self._stop) - 1 if self._stop and not self._include_stop else 0
        )

        self._text = ""
        self._num_output_tokens = 0
        self._stopped = False
        self._sent_offset = 0
        # The current run of plain (non-added) tokens, decoded together; it starts with the
        # prompt's tail, which only serves as context and is never emitted.
        self._run = self._prompt_context(prompt_token_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._run)
        self._prefix_text: str | None = None
        # Segment bookkeeping for the separator between added tokens and text.
        self._run_emitted = False
        self._any_segment = False

    @property
    def output_text(self) -> str:
        return self._text

    @property
    def num_output_tokens(self) -> int:
        return self._num_output_tokens

    @property
    def has_stop_strings(self) -> bool:
        return bool(self._stop)

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Add the step's new tokens; return the stop string that ended the text, if any.

        stop_terminated means the last token is a stop token (EOS or a stop id): its text
        is left out unless include_stop_str_in_output.
        """
        if self._stopped or not new_token_ids:
            return None
        decode_ids = new_token_ids
        if stop_terminated and not self._include_stop:
            decode_ids = new_token_ids[:-1]
        check_from = len(self._text)
        for token_id in decode_ids:
            self._num_output_tokens += 1
            self._text += self._decode_next(token_id)
            # No stop string may end the text within the first min_tokens tokens.
            if self._num_output_tokens <= self._min_tokens:
                check_from = len(self._text)
        self._num_output_tokens += len(new_token_ids) - len(decode_ids)
        if not self._stop or self._num_output_tokens <= self._min_tokens:
            return None
        found = self._find_stop(check_from)
        if found is None:
            return None
        stop, index = found
        end = index + len(stop) if self._include_stop else index
        self._text = self._text[:end]
        self._stopped = True
        return stop

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to publish now: everything so far, or (delta) only what is new since the
        last call. While not finished, the last max(len(stop)) - 1 characters stay back."""
        end = len(self._text) if finished else max(len(self._text) - self._hold_back, 0)
        if not delta:
            return self._text[:end]
        start = self._sent_offset
        if end <= start:
            return ""
        self._sent_offset = end
        return self._text[start:end]

    # ---- internals -----------------------------------------------------------------------

    def _prompt_context(self, prompt_token_ids: list[int]) -> list[int]:
        """The prompt's last plain tokens after its last added token that would show."""
        context: list[int] = []
        for token_id in reversed(prompt_token_ids):
            if len(context) == _PROMPT_CONTEXT_TOKENS:
                break
            if token_id in self._added:
                if self._skip_special and token_id in self._special_ids:
                    continue
                break
            context.append(token_id)
        context.reverse()
        return context

    def _decode_next(self, token_id: int) -> str:
        if token_id in self._added:
            if self._skip_special and token_id in self._special_ids:
                return ""
            # An added token ends the current run: what the run still holds comes out as
            # a full decode would give it, then the token as its own segment.
            text = self._flush_run()
            text += self._segment(self._added[token_id])
            self._run = []
            self._prefix_offset = self._read_offset = 0
            self._prefix_text = None
            self._run_emitted = False
            return text
        self._run.append(token_id)
        return self._emit_run(final=False)

    def _emit_run(self, final: bool) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._run[self._prefix_offset : self._read_offset])
        prefix_text = self._prefix_text
        new_text = self._decode(self._run[self._prefix_offset :])
        if len(new_text) <= len(prefix_text):
            return ""
        if new_text.endswith(_REPLACEMENT_CHAR) and not final:
            # Probably a character whose remaining bytes are still to come.
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._run)
        self._prefix_text = None
        if self._run_emitted:
            return new_text[len(prefix_text) :]
        self._run_emitted = True
        return self._segment(new_text[len(prefix_text) :])

    def _flush_run(self) -> str:
        if self._read_offset == len(self._run):
            return ""
        return self._emit_run(final=True)

    def _segment(self, text: str) -> str:
        """Open a new segment: the separator goes between it and the one before."""
        separator = self._separator if self._any_segment else ""
        self._any_segment = True
        return separator + text

    def _decode(self, token_ids: list[int]) -> str:
        if len(token_ids) == 1:
            token_id = token_ids[0]
            text = self._token_texts.get(token_id)
            if text is None:
                text = self._token_texts[token_id] = self._tokenizer.decode(
                    token_ids, skip_special_tokens=False
                )
            return text
        if not token_ids:
            return ""
        return self._tokenizer.decode(token_ids, skip_special_tokens=False)

    def _find_stop(self, check_from: int) -> tuple[str, int] | None:
        """The stop string that starts earliest in the text added since check_from (or
        overlapping it), with its start index."""
        best: tuple[str, int] | None = None
        for stop in self._stop:
            index = self._text.find(stop, max(check_from - len(stop) + 1, 0))
            if index != -1 and (best is None or index < best[1]):
                best = (stop, index)
        return best
