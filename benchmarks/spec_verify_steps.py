"""How n-gram verification steps split between CUDA graph layouts (runs on the CPU).

For each verification step (one with proposals): uniform (every request has k proposals:
replays the graph as it is), padded (some have fewer: replays it padded, see
asyncserve/worker/verify_layout.py), or eager (a prompt chunk longer than k + 1, or padding
that would cost too much). Real SmolLM2 weights on benchmarks/spec_decode.py's edit and
summarise prompts (or PLAIN_PROMPTS with --plain), greedy, at batch 1 and batch 4.

    python -m benchmarks.spec_verify_steps --k 4 --output-len 128 [--plain]
"""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

from asyncserve import SamplingParams
from asyncserve.llm import LLM
from asyncserve.worker import model_runner
from asyncserve.worker.input_batch import StepInputs
from asyncserve.worker.verify_layout import replays_verification, verify_capture_sizes
from benchmarks.spec_decode import prompt_token_ids
from tests.conftest import PLAIN_PROMPTS, smollm2_gguf_path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--plain", action="store_true")
    args = parser.parse_args()
    q = args.k + 1
    sizes = verify_capture_sizes(256)
    kinds: Counter[str] = Counter()
    proposals: Counter[int] = Counter()
    build = model_runner.build_step_inputs

    def recording(*a: Any, **kw: Any) -> StepInputs:
        inputs = build(*a, **kw)
        if inputs.spec_token_ids is not None:
            counts = inputs.counts
            proposals.update(len(s) for s in inputs.spec_token_ids)
            size = next((s for s in sizes if s >= len(counts)), None)
            if max(counts) > q:
                kinds["eager (prompt chunk)"] += 1
            elif min(counts) == q:
                kinds["uniform"] += 1
            elif replays_verification(counts, q, size):
                kinds["padded"] += 1
            else:
                kinds["eager (padding)"] += 1
        return inputs

    model_runner.build_step_inputs = recording  # type: ignore[assignment]
    gguf = str(smollm2_gguf_path())
    spec = {"method": "ngram", "num_speculative_tokens": args.k,
            "prompt_lookup_min": 1, "prompt_lookup_max": 3}  # fmt: skip
    llm = LLM(gguf, device="cpu", dtype="float32", max_model_len=1024,
              kv_cache_memory=64 << 20, speculative_config=spec)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    prompts: list[Any] = [{"prompt_token_ids": ids} for ids in prompt_token_ids(gguf)]
    if args.plain:
        prompts = PLAIN_PROMPTS[:4]
    for label, batches in (("batch 1", [[p] for p in prompts]), ("batch 4", [prompts])):
        kinds.clear()
        proposals.clear()
        for batch in batches:
            llm.generate(batch, params, use_tqdm=False)
        total = sum(kinds.values())
        shares = ", ".join(f"{k} {v} ({v / total:.0%})" for k, v in sorted(kinds.items()))
        print(f"k={args.k} {label}: {total} verification steps: {shares}")
        print("  proposals per request and step:", dict(sorted(proposals.items())))
    llm.close()


if __name__ == "__main__":
    main()
