"""Tensor parallel correctness on real devices: greedy fp32 output at TP=2 equal to TP=1,
token for token, on random-weight models (a Llama and a Qwen3-MoE, the latter with experts
sliced and with expert parallelism).

The checkpoints are built here with transformers (random weights saved as safetensors):
`--load-format dummy` draws each rank's slice from its own generator, so dummy weights
differ between tensor-parallel sizes and cannot be compared across them.

    python benchmarks/tp_equality.py [--device cuda] [--output-json F]   (JSON also to $OUT)

Exits 1 when any output differs. On CPU (gloo) it runs as is, only slower.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncserve import LLM, SamplingParams  # noqa: E402

VOCAB = 32000


def _configs() -> dict[str, Any]:
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
    )
    return {
        "llama": transformers.LlamaConfig(**common, intermediate_size=1408),
        "qwen3_moe": transformers.Qwen3MoeConfig(
            **common,
            head_dim=64,
            intermediate_size=1024,
            moe_intermediate_size=256,
            num_experts=8,
            num_experts_per_tok=2,
            mlp_only_layers=[3],
        ),
    }


def _save(name: str, config: Any, root: Path) -> Path:
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():  # larger than HF's init, so the logits are not all alike
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.05 + (1.0 if p.ndim == 1 else 0.0))
    path = root / name
    model.save_pretrained(path, safe_serialization=True)
    return path


def _greedy(path: Path, device: str, tp: int, ep: bool, prompts: list[list[int]]) -> list[Any]:
    llm = LLM(
        str(path),
        device=device,
        dtype="float32",
        tensor_parallel_size=tp,
        enable_expert_parallel=ep,
        max_model_len=1024,
        max_num_batched_tokens=256,  # chunked prefill for the longer prompts
        gpu_memory_utilization=0.3,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]
    finally:
        llm.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 40, 130, 300, 17, 600)]
    report: dict[str, Any] = {"device": args.device, "cases": {}}
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in _configs().items():
            path = _save(name, config, Path(tmp))
            start = time.perf_counter()
            expected = _greedy(path, args.device, 1, False, prompts)
            runs = [(2, False)] + ([(2, True)] if name == "qwen3_moe" else [])
            for tp, ep in runs:
                got = _greedy(path, args.device, tp, ep, prompts)
                same = [g == e for g, e in zip(got, expected, strict=True)]
                # Where a sequence first differs (fp32 sums in another order can flip a
                # near tie after many tokens): -1 when equal.
                first = [
                    next((i for i, (a, b) in enumerate(zip(g, e, strict=True)) if a != b), -1)
                    for g, e in zip(got, expected, strict=True)
                ]
                key = f"{name}_tp{tp}" + ("_ep" if ep else "")
                report["cases"][key] = {"equal": all(same), "first_difference": first}
                ok &= all(same)
                print(f"{key}: {'equal' if all(same) else 'DIFFERS'} to TP=1 {first}", flush=True)
            report["cases"][name + "_seconds"] = round(time.perf_counter() - start, 1)
    report["all_equal"] = ok
    out = args.output_json or (
        os.path.join(os.environ["OUT"], "tp_equality.json") if os.environ.get("OUT") else None
    )
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
