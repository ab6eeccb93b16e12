"""Grammar overhead per decode step: a batch where every request is constrained vs none.

Runs the offline engine on the default model (SmolLM2-135M GGUF) with `--batch` requests of
`--tokens` output tokens each. The constrained run gives every request a JSON schema that
cannot complete within the run (an array of at least 1000 objects), so every row is masked
at every step. Reported per decode step (steps after the batch's prefill):

- step wall time: the step loop from one update to the next (what a user sees);
- runner time: the forward thread's execute(), which includes waiting for the masks and
  applying them to the logits;
- grammar thread: filling the masks (overlaps the forward);
- mask apply, matcher advance: the parts on the critical path.

    python benchmarks/grammar_overhead.py [--batch 64] [--tokens 48] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncserve import SamplingParams  # noqa: E402
from asyncserve.engine import model_runner, structured  # noqa: E402
from asyncserve.llm import LLM  # noqa: E402
from asyncserve.sampling_params import StructuredOutputsParams  # noqa: E402

SCHEMA = {
    "type": "array",
    "minItems": 1000,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "count": {"type": "integer"},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}},
        },
        "required": ["name", "count"],
    },
}


class Timer:
    """Wraps a callable and records how long each call took."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.times: list[float] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.times.append(time.perf_counter() - start)


def run(llm: LLM, batch: int, tokens: int, constrained: bool) -> dict[str, float]:
    engine = llm.engine
    constraint = StructuredOutputsParams(json=SCHEMA) if constrained else None
    params = SamplingParams(
        temperature=0.0, max_tokens=tokens, ignore_eos=True, structured_outputs=constraint
    )
    prompts = [f"Request {i}: list the items in the warehouse as JSON." for i in range(batch)]

    execute = Timer(engine.runner.execute)
    fill = Timer(engine.structured.fill)
    accept = Timer(engine.structured.accept_tokens)
    apply = Timer(structured.apply_grammar_bitmask)
    update = Timer(engine.scheduler.update)
    update_at: list[float] = []
    original_update = update.fn

    def timed_update(*args: Any) -> Any:
        out = original_update(*args)
        update_at.append(time.perf_counter())
        return out

    update.fn = timed_update
    engine.runner.execute = execute  # type: ignore[method-assign]
    engine.structured.fill = fill  # type: ignore[method-assign]
    engine.structured.accept_tokens = accept  # type: ignore[method-assign]
    engine.scheduler.update = update  # type: ignore[method-assign]
    model_runner.apply_grammar_bitmask = apply  # type: ignore[attr-defined]
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        del engine.runner.execute, engine.structured.fill, engine.structured.accept_tokens
        del engine.scheduler.update
        model_runner.apply_grammar_bitmask = apply.fn  # type: ignore[attr-defined]
    assert all(len(o.outputs[0].token_ids) == tokens for o in outputs), "a request ended early"

    # Decode steps: skip the steps that still prefill (the first one or few) and the last.
    skip = len(execute.times) - tokens + 1
    gaps = [b - a for a, b in zip(update_at[skip:], update_at[skip + 1 :], strict=False)]
    decode = execute.times[skip:]

    def ms(values: list[float]) -> float:
        return 1e3 * statistics.median(values) if values else 0.0

    return {
        "step_wall_ms": ms(gaps),
        "runner_ms": ms(decode),
        "fill_ms": ms(fill.times[skip:]),
        "apply_ms": ms(apply.times[skip:]),
        "accept_ms": ms(accept.times[skip:]) if constrained else 0.0,
        "steps": float(len(gaps)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    llm = LLM(device=args.device, max_model_len=512, kv_cache_memory=256 << 20)
    run(llm, 8, 4, True)  # warm up: the grammar cache, the llguidance tokenizer
    results: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for _ in range(args.repeats):
        for constrained in (False, True):
            results[constrained].append(run(llm, args.batch, args.tokens, constrained))
    print(f"batch {args.batch}, {args.tokens} tokens, device {llm.engine.device}")
    for constrained, runs in results.items():
        best = min(runs, key=lambda r: r["step_wall_ms"])
        label = "every request constrained" if constrained else "no grammar"
        print(
            f"{label:>26}: step {best['step_wall_ms']:7.2f} ms  runner {best['runner_ms']:7.2f} ms"
            f"  fill {best['fill_ms']:6.2f} ms  apply {best['apply_ms']:6.2f} ms"
            f"  accept {best['accept_ms']:5.2f} ms  ({best['steps']:.0f} steps)"
        )
    base = min(r["step_wall_ms"] for r in results[False])
    with_grammar = min(r["step_wall_ms"] for r in results[True])
    print(f"overhead per step: {with_grammar - base:+.2f} ms ({(with_grammar / base - 1):+.1%})")
    llm.close()


if __name__ == "__main__":
    main()
