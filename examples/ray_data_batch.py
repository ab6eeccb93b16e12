"""Batch inference over a text file of prompts with Ray Data, written out as JSONL.

    python examples/ray_data_batch.py prompts.txt out/ --concurrency 2 --max-tokens 64

One prompt per line (ray.data.read_text); each replica loads the model once; the output
directory gets JSONL files (ray.data's writer) with the prompt and its generation. Runs on
the Ray cluster this process belongs to (RAY_ADDRESS, or a `ray start` on this machine),
else on a local one.
"""

from __future__ import annotations

import argparse

import ray

from asyncserve import SamplingParams
from asyncserve.ray_data import LLMProcessorConfig, build_llm_processor


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("prompts", help="text file, one prompt per line")
    parser.add_argument("output", help="directory for the JSONL files")
    parser.add_argument("--model", default=None, help="model path (default: SmolLM2-135M)")
    parser.add_argument("--concurrency", type=int, default=1, help="model replicas")
    parser.add_argument("--batch-size", type=int, default=32, help="prompts per batch")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="devices per replica")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    args = parser.parse_args(argv)

    config = LLMProcessorConfig(
        model_source=args.model,
        engine_kwargs={"tensor_parallel_size": args.tensor_parallel_size, "device": args.device},
        concurrency=args.concurrency,
        batch_size=args.batch_size,
    )
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    processor = build_llm_processor(
        config,
        sampling_params=params,
        postprocess=lambda row: {"prompt": row["text"], "generated_text": row["generated_text"]},
    )
    processor(ray.data.read_text(args.prompts)).write_json(args.output)


if __name__ == "__main__":
    main()
