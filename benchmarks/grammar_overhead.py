"""Grammar overhead per decode step: a batch where every request is constrained vs none.

Runs the offline engine on the default model (SmolLM2-135M GGUF) with `--batch` requests of
`--tokens` output tokens each. The constrained run gives every request a JSON schema that
cannot complete within the run (an array of at least 1000 objects), so every row is masked
at every step. Medians per decode step (the steps after the batch's prefill):

- step: the step loop from one update to the next (what a user sees);
- forward: the model's forward pass alone; on a shared CPU it swings by tens of percent from
  run to run, so the overhead is read from `step - forward` (everything but the forward);
- fill: filling the masks on the grammar thread (overlaps the forward);
- wait: the runner waiting for the masks right before sampling (0 when the fill finished
  during the forward);
- apply: masking the logits with the bitmask; accept: advancing the matchers by the last
  step's tokens (on the event loop, while the forward runs).

    python benchmarks/grammar_overhead.py [--batch 64] [--tokens 32] [--device cpu]
    python benchmarks/grammar_overhead.py --model benchmarks/configs/llama3-8b \
        --load-format dummy --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncserve import SamplingParams  # noqa: E402
from asyncserve.engine import model_runner, structured  # noqa: E402
from asyncserve.llm import LLM  # noqa: E402
from asyncserve.sampling_params import StructuredOutputsParams  # noqa: E402
from benchmarks.timing import Timer  # noqa: E402

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


class TimedFuture(Future):  # type: ignore[type-arg]
    """Mirrors a future; records how long the forward thread blocks in result()."""

    def __init__(self, inner: Future, waits: list[float]) -> None:  # type: ignore[type-arg]
        super().__init__()
        self.waits = waits
        inner.add_done_callback(lambda f: self.set_result(f.result()))

    def result(self, timeout: float | None = None) -> Any:
        start = time.perf_counter()
        value = super().result(timeout)
        if threading.current_thread().name.startswith("asyncserve-step"):
            self.waits.append(time.perf_counter() - start)
        return value


def run(llm: LLM, batch: int, tokens: int, constrained: bool) -> dict[str, float]:
    engine = llm.engine
    constraint = StructuredOutputsParams(json=SCHEMA) if constrained else None
    params = SamplingParams(
        temperature=0.0, max_tokens=tokens, ignore_eos=True, structured_outputs=constraint
    )
    prompts = [f"Request {i}: list the items in the warehouse as JSON." for i in range(batch)]

    forward = Timer(engine.runner.model.forward)
    fill = Timer(engine.structured.fill)
    accept = Timer(engine.structured.accept_tokens)
    apply = Timer(structured.apply_grammar_bitmask)
    waits: list[float] = []
    launch_sampling = engine.runner.launch_sampling
    update = engine.scheduler.update
    update_at: list[float] = []

    def timed_sampling(forwarded: Any, grammar: Any = None) -> Any:
        return launch_sampling(forwarded, None if grammar is None else TimedFuture(grammar, waits))

    def timed_update(*args: Any) -> Any:
        out = update(*args)
        update_at.append(time.perf_counter())
        return out

    engine.runner.model.forward = forward  # type: ignore[method-assign]
    engine.structured.fill = fill  # type: ignore[method-assign]
    engine.structured.accept_tokens = accept  # type: ignore[method-assign]
    engine.runner.launch_sampling = timed_sampling  # type: ignore[method-assign]
    engine.scheduler.update = timed_update  # type: ignore[method-assign]
    model_runner.apply_grammar_bitmask = apply  # type: ignore[attr-defined]
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        del engine.runner.model.forward
        del engine.structured.fill, engine.structured.accept_tokens
        del engine.runner.launch_sampling
        del engine.scheduler.update
        model_runner.apply_grammar_bitmask = apply.fn  # type: ignore[attr-defined]
    assert all(len(o.outputs[0].token_ids) == tokens for o in outputs), "a request ended early"

    # Decode steps: skip the steps that still prefill (the first one or few).
    skip = len(update_at) - tokens + 1
    gaps = [b - a for a, b in zip(update_at[skip:], update_at[skip + 1 :], strict=False)]

    def ms(values: list[float]) -> float:
        return 1e3 * statistics.median(values) if values else 0.0

    # Replayed CUDA graphs bypass model.forward: then the forward is not timed on its own.
    timed_forward = engine.runner.decode_graphs is None
    return {
        "step": ms(gaps),
        "forward": ms(forward.times[skip + 1 :]) if timed_forward else float("nan"),
        "fill": ms(fill.times[skip:]),
        "wait": ms(waits[skip:]),
        "apply": ms(apply.times[skip:]),
        "accept": ms(accept.times[skip:]) if constrained else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--model", default=None, help="default: the SmolLM2 GGUF")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument(
        "--switch-interval", type=float, default=None, help="sys.setswitchinterval (seconds)"
    )
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="default: on with CUDA, off on CPU, as the engine does",
    )
    args = parser.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    kv_bytes = (256 << 20) if args.device == "cpu" else None
    llm = LLM(
        model=args.model,
        load_format=args.load_format,
        device=args.device,
        max_model_len=512,
        kv_cache_memory=kv_bytes,
        async_scheduling=args.async_scheduling,
    )
    run(llm, 8, 4, True)  # warm up: the grammar cache, the llguidance tokenizer
    results: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for _ in range(args.repeats):  # interleaved, so drifting machine load hits both alike
        for constrained in (False, True):
            results[constrained].append(run(llm, args.batch, args.tokens, constrained))
    print(f"batch {args.batch}, {args.tokens} tokens, device {llm.engine.device}, ms per step")
    rest: dict[bool, float] = {}
    for constrained, runs in results.items():
        fields = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        rest[constrained] = statistics.median(r["step"] - r["forward"] for r in runs)
        label = "every request constrained" if constrained else "no grammar"
        print(
            f"{label:>26}: step {fields['step']:8.2f}  forward {fields['forward']:8.2f}  "
            f"step-forward {rest[constrained]:6.2f}  fill {fields['fill']:5.2f}  "
            f"wait {fields['wait']:5.2f}  apply {fields['apply']:5.2f}  "
            f"accept {fields['accept']:5.2f}"
        )
    runs = results[True]
    critical = statistics.median(r["wait"] + r["apply"] for r in runs)
    step = statistics.median(r["step"] for r in runs)
    plain = statistics.median(r["step"] for r in results[False])
    print(f"step time, every request constrained vs none: {step / plain - 1:+.1%}")
    print(
        f"grammar cost on the step thread (wait + apply): {critical:.2f} ms "
        f"({critical / step:.2%} of a step); step - forward moved by "
        f"{rest[True] - rest[False]:+.2f} ms"
    )
    llm.close()


if __name__ == "__main__":
    main()
