"""The engine's per-token logprobs in the two OpenAI shapes.

Completions: {tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}.
Chat: {content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from asyncserve.http.protocol import (
    ChatLogprobEntry,
    ChatLogprobs,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
)
from asyncserve.outputs import Logprob, LogprobsDict


class TokenText:
    """Token id -> its text, from the engine's decoded_token or the tokenizer (memoized);
    "token_id:<id>" instead with as_ids (vLLM's return_tokens_as_token_ids)."""

    def __init__(self, tokenizer: Any, as_ids: bool = False) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self.as_ids = as_ids

    def with_ids(self) -> TokenText:
        """The same tokenizer and cache, spelling tokens as "token_id:<id>"."""
        other = TokenText(self._tokenizer, as_ids=True)
        other._cache = self._cache
        return other

    def __call__(self, token_id: int, logprob: Logprob | None = None) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


def _finite(value: float) -> float:
    """JSON has no -inf: a token the sampler ruled out gets -9999.0, as vLLM reports it."""
    return value if value > -9999.0 else -9999.0


def _sorted(entry: LogprobsDict) -> list[tuple[int, Logprob]]:
    return sorted(entry.items(), key=lambda kv: -kv[1].logprob)


def completion_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[LogprobsDict | None],
    token_text: TokenText,
    text_offset: int,
) -> CompletionLogprobs:
    """Legacy-completions logprobs for `token_ids`; offsets start at `text_offset`."""
    out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    offset = text_offset
    for token_id, entry in zip(token_ids, logprobs, strict=False):
        chosen = entry.get(token_id) if entry is not None else None
        text = token_text(token_id, chosen)
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(_finite(chosen.logprob) if chosen is not None else None)
        out.top_logprobs.append(
            {token_text(tid, lp): _finite(lp.logprob) for tid, lp in _sorted(entry)}
        )
    return out


def chat_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[LogprobsDict | None],
    token_text: TokenText,
    num_top: int,
) -> ChatLogprobs:
    content: list[ChatLogprobEntry] = []
    for token_id, entry in zip(token_ids, logprobs, strict=False):
        entry = entry or {}
        chosen = entry.get(token_id)
        text = token_text(token_id, chosen)
        top = [
            TopLogprob(token=t, logprob=_finite(lp.logprob), bytes=list(t.encode("utf-8")))
            for t, lp in (
                (token_text(tid, lp), lp)
                for tid, lp in _sorted(entry)
                if lp.rank is None or lp.rank <= num_top
            )
        ][:num_top]
        content.append(
            ChatLogprobEntry(
                token=text,
                logprob=_finite(chosen.logprob) if chosen is not None else -9999.0,
                bytes=list(text.encode("utf-8")),
                top_logprobs=top,
            )
        )
    return ChatLogprobs(content=content)


def prompt_logprobs(entries: Sequence[LogprobsDict | None] | None) -> PromptLogprobs | None:
    """The engine's prompt logprobs in vLLM's response shape."""
    if entries is None:
        return None
    return [
        None
        if entry is None
        else {
            tid: PromptLogprob(
                logprob=_finite(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token
            )
            for tid, lp in entry.items()
        }
        for entry in entries
    ]
