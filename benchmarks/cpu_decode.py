"""CPU decode tokens/s for SmolLM2 at batch 1 and 16, with HF transformers generate as the
peer in the same run (same GGUF weights, fp32)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from asyncserve import SamplingParams
from asyncserve.llm import LLM
from asyncserve.models.loader import default_model_path


def bench_ours(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate(prompts, one, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    llm.generate(prompts, one, use_tqdm=False)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    total = time.perf_counter() - start
    return len(prompts) * (new_tokens - 1) / (total - prefill)


def bench_hf(model, prompts: list[list[int]], new_tokens: int) -> float:  # type: ignore[no-untyped-def]
    ids = torch.tensor(prompts)
    kwargs = {"do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    with torch.no_grad():
        model.generate(ids, max_new_tokens=1, **kwargs)
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, **kwargs)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        total = time.perf_counter() - start
    return len(prompts) * (new_tokens - 1) / (total - prefill)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    args = parser.parse_args()
    import transformers

    path = default_model_path()
    llm = LLM(model=path, device="cpu", dtype="float32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(Path(path).parent),
        gguf_file=Path(path).name,
        dtype=torch.float32,
    ).eval()
    ids = llm.get_tokenizer().encode("The history of the city begins " * 16)[: args.prompt_len]
    print(f"torch threads: {torch.get_num_threads()}")
    for batch in (1, 16):
        prompts = [ids] * batch
        ours = bench_ours(llm, prompts, args.new_tokens)
        theirs = bench_hf(hf, prompts, args.new_tokens)
        print(
            f"batch {batch:2d}: asyncserve {ours:7.1f} tok/s, HF generate {theirs:7.1f} tok/s, "
            f"ratio {ours / theirs:.2f}x"
        )


if __name__ == "__main__":
    main()
