"""W1b-style offline throughput with LoRA adapters spread over the batch, asyncserve or vLLM.

    python benchmarks/lora_throughput.py --engine asyncserve --num-adapters 0   # the base
    python benchmarks/lora_throughput.py --engine asyncserve --num-adapters 8
    python benchmarks/lora_throughput.py --engine vllm --num-adapters 8

Dummy Llama-3-8B weights (benchmarks/configs/llama3-8b), 1000 prompts of 256 random tokens,
256 output tokens each (greedy, ignore_eos), max_model_len 2048; prompt i runs with adapter
i % N. The adapters are random rank-R PEFT adapters on q/k/v/o/gate/up/down written to
--adapter-dir, so both engines read the same files. One JSON report per run.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapters(config_dir: Path, out: Path, count: int, rank: int) -> list[Path]:
    """`count` random PEFT LoRA adapters for the model described by config.json."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((config_dir / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
              "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
              "down_proj": (inter, hidden)}  # fmt: skip
    paths = []
    for index in range(count):
        path = out / f"adapter{index}"
        path.mkdir(parents=True, exist_ok=True)
        gen = torch.Generator().manual_seed(index)
        tensors = {}
        for layer in range(cfg["num_hidden_layers"]):
            for module in MODULES:
                kind = "self_attn" if module in MODULES[:4] else "mlp"
                prefix = f"base_model.model.model.layers.{layer}.{kind}.{module}"
                fan_in, fan_out = shapes[module]
                a = torch.randn(rank, fan_in, generator=gen) / math.sqrt(fan_in)
                b = torch.randn(fan_out, rank, generator=gen) * 0.01
                tensors[f"{prefix}.lora_A.weight"] = a.to(torch.bfloat16)
                tensors[f"{prefix}.lora_B.weight"] = b.to(torch.bfloat16)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
                  "target_modules": list(MODULES), "bias": "none", "task_type": "CAUSAL_LM",
                  "base_model_name_or_path": str(config_dir)}  # fmt: skip
        (path / "adapter_config.json").write_text(json.dumps(config))
        paths.append(path)
    return paths


def run_asyncserve(
    args: argparse.Namespace, prompts: list[list[int]], adapters: list[Path]
) -> float:
    from asyncserve import LoRARequest, SamplingParams
    from asyncserve.llm import LLM

    n = len(adapters)
    llm = LLM(args.model, load_format="dummy", max_model_len=args.max_model_len,
              enable_lora=n > 0, max_loras=max(n, 1), max_lora_rank=args.rank)  # fmt: skip
    loras = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    per_prompt = [loras[i % n] for i in range(len(prompts))] if n else None
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    warm = per_prompt[:8] if per_prompt else None
    _phase("engine ready; warm-up (8 prompts, every adapter read on first use)")
    llm.generate(prompts[:8], params, use_tqdm=False, lora_request=warm)
    _phase(f"warm-up done; generating {len(prompts)} prompts")
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False, lora_request=per_prompt)
    elapsed = time.perf_counter() - start
    _phase(f"generated in {elapsed:.1f} s; closing the engine")
    llm.close()
    return elapsed


def _phase(message: str) -> None:
    """Progress on stderr at once (stdout to a pipe is held back until the process ends)."""
    print(f"[lora_throughput {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run_vllm(args: argparse.Namespace, prompts: list[list[int]], adapters: list[Path]) -> float:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    n = len(adapters)
    extra: dict[str, Any] = (
        {"enable_lora": True, "max_loras": n, "max_lora_rank": args.rank} if n else {}
    )
    llm = LLM(args.model, load_format="dummy", max_model_len=args.max_model_len,
              skip_tokenizer_init=True, **extra)  # fmt: skip
    loras = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    per_prompt = [loras[i % n] for i in range(len(prompts))] if n else None
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True,
                            detokenize=False)  # fmt: skip
    inputs: list[Any] = [{"prompt_token_ids": p} for p in prompts]
    warm = per_prompt[:8] if per_prompt else None
    llm.generate(inputs[:8], params, use_tqdm=False, lora_request=warm)
    start = time.perf_counter()
    llm.generate(inputs, params, use_tqdm=False, lora_request=per_prompt)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", choices=["asyncserve", "vllm"], default="asyncserve")
    parser.add_argument("--model", default="benchmarks/configs/llama3-8b")
    parser.add_argument("--num-adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--adapter-dir", default="/tmp/lora-bench-adapters")
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--dump-stacks-after", type=float, default=100.0,
                        help="every this many seconds, print every thread's stack to stderr "
                        "(where a run that does not finish waits); 0: never")  # fmt: skip
    args = parser.parse_args()
    # The engine's INFO lines (graph capture, KV budget, adapter reads) show how far it got.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.dump_stacks_after > 0:
        faulthandler.dump_traceback_later(args.dump_stacks_after, repeat=True)

    from asyncserve.bench.workload import random_prompts

    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    prompts = random_prompts(args.num_prompts, args.input_len, vocab, seed=0)
    adapters = write_adapters(
        Path(args.model), Path(args.adapter_dir), args.num_adapters, args.rank
    )
    _phase(f"{len(adapters)} adapters written to {args.adapter_dir}; starting {args.engine}")
    runner = run_asyncserve if args.engine == "asyncserve" else run_vllm
    elapsed = runner(args, prompts, adapters)
    num_in = sum(len(p) for p in prompts)
    num_out = args.output_len * len(prompts)
    report = {
        "engine": args.engine,
        "num_adapters": args.num_adapters,
        "rank": args.rank,
        "num_prompts": len(prompts),
        "elapsed_s": elapsed,
        "requests_per_s": len(prompts) / elapsed,
        "total_tokens_per_s": (num_in + num_out) / elapsed,
        "output_tokens_per_s": num_out / elapsed,
    }
    faulthandler.cancel_dump_traceback_later()
    print(json.dumps(report), flush=True)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
