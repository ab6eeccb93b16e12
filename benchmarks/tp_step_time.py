"""Per-step time of a real tensor-parallel engine: decode steps of a dummy-weight Llama with a
large vocabulary, where the logits' trip from the ranks to the sampler is a visible share of
the step (the LM head's collective).

A decode step's time is the slope between two runs of the same batch that differ only in
their number of output tokens (the prefill and the engine start cancel out). Medians over
`--repeats`, in milliseconds, per batch size; `--tp 1` gives the one-device baseline.

    python benchmarks/tp_step_time.py [--tp 2] [--device cpu] [--vocab 65536] \
        [--batches 1 32] [--output-json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncserve import LLM, SamplingParams  # noqa: E402


def write_model(root: Path, vocab: int, hidden: int, layers: int) -> Path:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    return root


def timed(llm: LLM, batch: int, tokens: int) -> float:
    prompts = [[3 + i, 4 + i, 5 + i, 6 + i] for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def main() -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--vocab", type=int, default=65536)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--short", type=int, default=8)
    parser.add_argument("--long", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = write_model(Path(tmp) / "llama", args.vocab, args.hidden, args.layers)
        llm = LLM(str(root), load_format="dummy", tensor_parallel_size=args.tp,
                  device=args.device, dtype="float32", max_model_len=256)  # fmt: skip
        results: dict[str, Any] = {"tp": args.tp, "device": args.device, "vocab": args.vocab}
        try:
            for batch in args.batches:
                timed(llm, batch, args.short)  # warm-up
                slopes = []
                for _ in range(args.repeats):
                    extra = timed(llm, batch, args.long) - timed(llm, batch, args.short)
                    slopes.append(1000 * extra / (args.long - args.short))
                results[f"batch_{batch}_step_ms"] = round(statistics.median(slopes), 3)
                print(f"tp={args.tp} batch={batch}: {results[f'batch_{batch}_step_ms']} ms/step")
        finally:
            llm.close()
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
