"""Where a lone LLaVA request's time goes in asyncserve (offline, one GPU): each phase timed on
its own (host clock, the device synchronized around it), medians of --reps, next to the
whole request and a text-only request of the same length.

    python benchmarks/llava_phases.py [--model-dir /tmp/llava-7b-dummy] [--tiny --device cpu]

Phases: the front end's processing (preprocessing, hashing, placeholder expansion); the
pixels' way to the device (stack, pin, copy; and a plain pageable copy); the vision tower
and projector (`embed_images`); the whole request (a new image each time); a text-only
request with as many prompt tokens (the language model's prefill and the step's overhead).
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from llava_bench import make_requests, write_checkpoint  # benchmarks/ is this script's folder

from asyncserve.llm import LLM
from asyncserve.sampling_params import SamplingParams


def timed(fn: Callable[[int], Any], reps: int, device: torch.device) -> float:
    """Median ms of fn(i) over reps calls (after one warm-up), the device synchronized."""
    fn(reps)
    times = []
    for i in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn(i)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return round(1e3 * statistics.median(times), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", default="/tmp/llava-7b-dummy")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    write_checkpoint(Path(args.model_dir), args.tiny)
    llm = LLM(args.model_dir, device=args.device, load_format="dummy", max_model_len=2048)
    engine: Any = llm._engine
    model = engine.runner.model
    device = next(model.parameters()).device
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    n = args.reps + 1
    requests = make_requests(3 * n, args.input_len, seed=7)
    llm.generate(make_requests(2, args.input_len, seed=99), one, use_tqdm=False)

    def process(i: int) -> Any:
        r = requests[i]
        return engine.multimodal.process(r["prompt_token_ids"], r["multi_modal_data"])

    processed = [process(i) for i in range(n)]
    items = [p.features.items for p in processed]
    pixels = [torch.stack([it.data["pixel_values"] for it in group]) for group in items]
    report: dict[str, Any] = {"device": str(device), "reps": args.reps}
    report["front_end_process_ms"] = timed(process, args.reps, device)
    report["stack_ms"] = timed(
        lambda i: torch.stack([it.data["pixel_values"] for it in items[i]]), args.reps, device
    )
    if device.type == "cuda":
        report["pin_ms"] = timed(lambda i: pixels[i].pin_memory(), args.reps, device)
        report["pin_and_copy_ms"] = timed(
            lambda i: pixels[i].pin_memory().to(device, non_blocking=True), args.reps, device
        )
    report["pageable_copy_ms"] = timed(lambda i: pixels[i].to(device), args.reps, device)
    with torch.inference_mode():
        report["embed_images_ms"] = timed(lambda i: model.embed_images(items[i]), args.reps, device)
    report["request_ms"] = timed(
        lambda i: llm.generate([requests[n + i]], one, use_tqdm=False), args.reps, device
    )
    prompt_len = len(processed[0].prompt_token_ids)
    texts = [
        {"prompt_token_ids": [1 + (7 * i + j) % 30000 for j in range(prompt_len)]} for i in range(n)
    ]
    report["text_request_ms"] = timed(
        lambda i: llm.generate([texts[i]], one, use_tqdm=False), args.reps, device
    )
    report["prompt_tokens"] = prompt_len
    fresh = [
        {"prompt_token_ids": [1 + (11 * i + 3 * j) % 30000 for j in range(prompt_len)]}
        for i in range(n)
    ]  # not in the prefix cache
    report["text_request_anatomy_ms"] = anatomy(llm, engine.runner, fresh, device)
    report["request_anatomy_ms"] = anatomy(llm, engine.runner, requests[2 * n :], device)
    print(json.dumps(report), flush=True)


def anatomy(llm: LLM, runner: Any, prompts: list[Any], device: torch.device) -> dict[str, float]:
    """A lone request's timeline on the host (medians, ms from generate()'s call): when the
    worker's forward, sampling and collection of each step begin and end, and the end."""
    marks: dict[str, list[float]] = {}
    start = [0.0]

    def wrap(name: str) -> None:
        original = getattr(runner, name)

        def timed_call(*args: Any, **kwargs: Any) -> Any:
            key = f"{name}#{sum(k.startswith(name) for k in seen)}"
            seen.append(key)
            marks.setdefault(key + " start", []).append(time.perf_counter() - start[0])
            try:
                return original(*args, **kwargs)
            finally:
                marks.setdefault(key + " end", []).append(time.perf_counter() - start[0])

        setattr(runner, name, timed_call)

    seen: list[str] = []
    for name in ("launch_forward", "launch_sampling", "collect"):
        wrap(name)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    try:
        for prompt in prompts[:9]:
            seen.clear()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start[0] = time.perf_counter()
            llm.generate([prompt], one, use_tqdm=False)
            marks.setdefault("done", []).append(time.perf_counter() - start[0])
    finally:
        for name in ("launch_forward", "launch_sampling", "collect"):
            delattr(runner, name)  # the class's methods again
    return {key: round(1e3 * statistics.median(v), 2) for key, v in marks.items()}


if __name__ == "__main__":
    main()
