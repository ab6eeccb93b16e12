"""allowed_token_ids under a structured-output constraint: the sampler keeps the tokens in
both sets, so where they share none every logit is masked and the token drawn breaks the
grammar. A request whose allowed tokens cannot start the output is refused up front (a
ValueError naming allowed_token_ids); one that runs into the conflict later ends alone, with
an error saying so rather than the grammar engine's parse error. bad_words that rule out
every token the grammar allows next end a request the same way, with an error naming them."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np
from llguidance import LLMatcher

NO_ALLOWED_TOKEN = "allowed_token_ids: no allowed token can continue the constrained output"
NO_UNBANNED_TOKEN = "bad_words: every token the constrained output allows next is a bad word"


def grammar_token_ids(matcher: LLMatcher) -> set[int]:
    """The tokens the grammar accepts next; the matcher is left as it was."""
    # One bit per token: token t at byte t // 8, bit t % 8.
    mask = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    return set(np.flatnonzero(np.unpackbits(mask, bitorder="little")).tolist())


def allows_any(matcher: LLMatcher, token_ids: Collection[int]) -> bool:
    """Whether the grammar accepts any of `token_ids` next; the matcher is left as it was."""
    return not grammar_token_ids(matcher).isdisjoint(token_ids)


def banned_by_bad_words(bad_words_token_ids: Sequence[list[int]], output: list[int]) -> set[int]:
    """The tokens bad words rule out after `output`: each word's last token where its other
    tokens end the output (as the sampler bans them)."""
    banned: set[int] = set()
    for word in bad_words_token_ids:
        prefix = len(word) - 1
        if prefix <= len(output) and (prefix == 0 or output[-prefix:] == word[:-1]):
            banned.add(word[-1])
    return banned


def check_allowed_start(template: LLMatcher, allowed_token_ids: Collection[int] | None) -> None:
    """ValueError naming allowed_token_ids when none of them can be the output's first
    token. `template`: the constraint's cached matcher, not advanced (a copy is probed)."""
    if allowed_token_ids is None:
        return
    if not allows_any(template.deep_copy(), allowed_token_ids):
        raise ValueError(
            f"{NO_ALLOWED_TOKEN}: structured_outputs allows none of the "
            f"{len(allowed_token_ids)} allowed tokens as the first token"
        )


def rejection_message(
    matcher: LLMatcher,
    token_id: int,
    num_output: int,
    allowed_token_ids: Collection[int] | None,
    banned: Collection[int] = (),
) -> str:
    """Why the grammar rejected `token_id`, sampled as output token `num_output` (from 0);
    `matcher` stands just before it and is not to be used again. `banned`: the tokens bad
    words ruled out at that position."""
    if allowed_token_ids is not None and not allows_any(matcher, allowed_token_ids):
        return (
            f"{NO_ALLOWED_TOKEN}: the structured output allows none of the "
            f"{len(allowed_token_ids)} allowed tokens as output token {num_output + 1}"
        )
    if banned:
        left = grammar_token_ids(matcher)
        if allowed_token_ids is not None:
            left &= set(allowed_token_ids)
        if left and left <= set(banned):
            return (
                f"{NO_UNBANNED_TOKEN}: the structured output allows only tokens that "
                f"bad_words rules out as output token {num_output + 1}"
            )
    matcher.consume_token(token_id)
    error = matcher.get_error().replace("<non-verbose/>", "").strip()
    return f"structured output failed: {error or 'token rejected by the grammar'}"
