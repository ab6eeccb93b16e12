"""Beam search on top of the engine, with vLLM's semantics (vllm/beam_search.py and
`LLM.beam_search` in vllm/entrypoints/llm.py).

Every step submits each live beam as an ordinary request: the beam's tokens (prompt and
output so far) as the prompt, max_tokens=1, logprobs=2 * beam_width. Each beam is extended
by each of its top 2 * beam_width tokens (plus the sampled one, when temperature > 0 picks a
token outside them); per prompt, candidates ending in EOS (unless ignore_eos) move to the
completed list, and the best beam_width of the others, by `get_beam_search_score`, live on.
After max_tokens steps (or when no beam is left) completed and live beams are ranked
together and the best beam_width are returned, best first.

KV sharing. No beam owns KV blocks between steps: the engine's prefix cache does the
sharing. A step's requests for one prompt hash to the same full blocks, so the prompt's and
the common output prefix's full blocks are computed once and then held by reference count
by every beam that extends them (and stay cached, evictable, between steps). The last,
partial block is never shared: each beam recomputes it, at most block_size - 1 tokens plus
its newest token per step. That is copy-on-write of the partial block, at block granularity:
a beam's divergent tail gets its own block, and a block becomes shared once it is full.

Differences from vLLM, both deliberate: every EOS id of the model ends a beam (vLLM looks at
the tokenizer's only), and a beam that reaches max_model_len completes with finish_reason
"length" (vLLM drops it).
"""

from __future__ import annotations

import asyncio
import math
import numbers
from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from asyncserve.outputs import CompletionOutput, LogprobsDict, RequestOutput
from asyncserve.sampling_params import RequestOutputKind, SamplingParams

# The engine returns at most 20 logprobs; each step asks for 2 * beam_width.
MAX_BEAM_WIDTH = 10


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(
                f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}], got {self.beam_width}"
            )
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens}")
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            # A NaN score would leave the beams' order, and so the result, arbitrary.
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                raise ValueError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


@dataclass
class BeamSearchSequence:
    """One beam. As in vLLM, `tokens` includes the prompt; `text` is filled at the end."""

    tokens: list[int]
    logprobs: list[LogprobsDict] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    num_prompt_tokens: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]


@dataclass
class BeamSearchOutput:
    """The best beam_width sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(
    tokens: Sequence[int],
    cumulative_logprob: float,
    eos_token_id: int | Collection[int] | None,
    length_penalty: float = 1.0,
) -> float:
    """cum_logprob / seq_len ** length_penalty, as vLLM scores beams.

    seq_len counts the prompt and the output, the final EOS excluded (HF transformers'
    BeamHypotheses, which vLLM adapted, leaves EOS out of the length too).
    """
    if eos_token_id is None:
        eos_ids: Collection[int] = ()
    elif isinstance(eos_token_id, int):
        eos_ids = (eos_token_id,)
    else:
        eos_ids = eos_token_id
    seq_len = len(tokens)
    if tokens and tokens[-1] in eos_ids:
        seq_len -= 1
    try:
        norm = max(seq_len, 1) ** length_penalty
    except OverflowError:  # a huge length_penalty: the length term dwarfs the logprob
        norm = math.inf
    if norm == 0.0:  # a hugely negative one underflows: dividing by it would raise
        return -math.inf if cumulative_logprob < 0 else 0.0
    return cumulative_logprob / norm


class BeamEngine(Protocol):
    """What beam search uses of the engine (asyncserve.engine.async_engine.AsyncEngine)."""

    tokenizer: Any
    max_model_len: int
    eos_token_ids: list[int]

    def validate_request(
        self, prompt_token_ids: list[int], params: SamplingParams, strict_max_tokens: bool = True
    ) -> None: ...

    def generate(
        self, prompt: str | list[int], sampling_params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]: ...


@dataclass
class _Instance:
    beams: list[BeamSearchSequence]
    completed: list[BeamSearchSequence] = field(default_factory=list)


async def beam_search(
    engine: BeamEngine,
    prompts: Sequence[list[int]],
    params: BeamSearchParams,
    request_id_prefix: str = "beam",
    skip_special_tokens: bool = False,
) -> list[BeamSearchOutput]:
    """Beam search for each prompt (token ids); all prompts' beams share each step's batch.

    `text` of each sequence is the decoded tokens, prompt included, as vLLM's offline API
    returns it (special tokens kept unless skip_special_tokens).
    """
    eos_ids = frozenset() if params.ignore_eos else frozenset(engine.eos_token_ids)
    max_len = engine.max_model_len

    def score(beam: BeamSearchSequence) -> float:
        return get_beam_search_score(beam.tokens, beam.cum_logprob, eos_ids, params.length_penalty)

    for prompt in prompts:
        engine.validate_request(prompt, SamplingParams(max_tokens=1), strict_max_tokens=False)
    step_params = SamplingParams(
        temperature=params.temperature,
        max_tokens=1,
        logprobs=2 * params.beam_width,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    instances = [
        _Instance([BeamSearchSequence(list(p), num_prompt_tokens=len(p))]) for p in prompts
    ]
    for step in range(params.max_tokens):
        for instance in instances:
            # A beam at max_model_len cannot grow: it completes as it is.
            full = [b for b in instance.beams if len(b.tokens) >= max_len]
            for beam in full:
                beam.finish_reason = "length"
            instance.completed.extend(full)
            instance.beams = [b for b in instance.beams if len(b.tokens) < max_len]
        live = [(i, beam) for i, inst in enumerate(instances) for beam in inst.beams]
        if not live:
            break
        results = await asyncio.gather(
            *(
                _next_logprobs(engine, beam.tokens, step_params, f"{request_id_prefix}-{step}-{j}")
                for j, (_, beam) in enumerate(live)
            )
        )
        candidates: list[list[BeamSearchSequence]] = [[] for _ in instances]
        for (index, beam), logprobs in zip(live, results, strict=True):
            for token_id, entry in logprobs.items():
                child = BeamSearchSequence(
                    tokens=beam.tokens + [token_id],
                    logprobs=beam.logprobs + [logprobs],
                    cum_logprob=beam.cum_logprob + entry.logprob,
                    num_prompt_tokens=beam.num_prompt_tokens,
                )
                if token_id in eos_ids:
                    child.finish_reason = "stop"
                    instances[index].completed.append(child)
                else:
                    candidates[index].append(child)
        for instance, new_beams in zip(instances, candidates, strict=True):
            new_beams.sort(key=score, reverse=True)
            instance.beams = new_beams[: params.beam_width]

    outputs = []
    for instance in instances:
        for beam in instance.beams:
            beam.finish_reason = beam.finish_reason or "length"
        ranked = sorted(instance.completed + instance.beams, key=score, reverse=True)
        best = ranked[: params.beam_width]
        for beam in best:
            beam.text = engine.tokenizer.decode(
                beam.tokens, skip_special_tokens=skip_special_tokens
            )
        outputs.append(BeamSearchOutput(sequences=best))
    return outputs


async def _next_logprobs(
    engine: BeamEngine, tokens: list[int], params: SamplingParams, request_id: str
) -> LogprobsDict:
    """Top logprobs of the token after `tokens` (one engine request, one output token)."""
    final = None
    async for output in engine.generate(tokens, params, request_id):
        final = output
    if final is None or final.error is not None:
        error = final.error if final is not None else "no output"
        raise RuntimeError(f"beam search step {request_id} failed: {error}")
    step = final.outputs[0].logprobs
    if not step:
        raise RuntimeError(f"beam search step {request_id} returned no logprobs")
    return step[0]


def to_request_output(
    engine: BeamEngine,
    request_id: str,
    prompt: str | None,
    prompt_token_ids: list[int],
    output: BeamSearchOutput,
    n: int,
) -> RequestOutput:
    """The best n beams as one finished RequestOutput, as vLLM's server returns beam search.

    Each completion holds the output only; its text leaves out the final EOS and special tokens.
    """
    eos_ids = set(engine.eos_token_ids)
    completions = []
    for index, beam in enumerate(output.sequences[:n]):
        tokens = beam.output_token_ids
        ends_with_eos = beam.finish_reason == "stop" and bool(tokens) and tokens[-1] in eos_ids
        text = engine.tokenizer.decode(tokens[:-1] if ends_with_eos else tokens)
        completions.append(
            CompletionOutput(
                index=index,
                text=text,
                token_ids=list(tokens),
                cumulative_logprob=beam.cum_logprob,
                logprobs=list(beam.logprobs),
                finish_reason=beam.finish_reason or "length",
            )
        )
    return RequestOutput(
        request_id=request_id,
        prompt=prompt,
        prompt_token_ids=prompt_token_ids,
        outputs=completions,
        finished=True,
    )
