"""Qwen2.5-VL offline throughput and TTFT with one image per request (dummy weights).

Writes a config-only checkpoint (the published 7B shape, or a tiny one with --tiny) and runs
N requests, each a short text around one random image of --image-size pixels (448 -> 256
image tokens), through LLM.generate; prints and writes JSON (requests/s, output tokens/s,
TTFT mean / p50 / p99, images encoded). With --repeat the same image is sent to every
request, to measure the encoder cache.

    python benchmarks/qwen2_5_vl_bench.py --out $OUT/qwen2_5_vl.json
    python benchmarks/qwen2_5_vl_bench.py --tiny --device cpu --requests 4   # smoke run
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

IMAGE_TOKEN_ID = 151655
VISION_START_ID = 151652
VISION_END_ID = 151653

SHAPE_7B: dict[str, Any] = {
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "vision": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16},
    "fullatt": [7, 15, 23, 31],
    "mrope_section": [16, 24, 24],
}
SHAPE_TINY: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "vision": {"depth": 4, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2},
    "fullatt": [1, 3],
    "mrope_section": [2, 3, 3],
}


def write_config(root: Path, shape: dict[str, Any]) -> None:
    config = {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "vocab_size": 152064,
        "hidden_size": shape["hidden_size"],
        "intermediate_size": shape["intermediate_size"],
        "num_attention_heads": shape["num_attention_heads"],
        "num_hidden_layers": shape["num_hidden_layers"],
        "num_key_value_heads": shape["num_key_value_heads"],
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": shape["mrope_section"]},
        "torch_dtype": "bfloat16",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "image_token_id": IMAGE_TOKEN_ID,
        "vision_start_token_id": VISION_START_ID,
        "vision_end_token_id": VISION_END_ID,
        "vision_config": {
            **shape["vision"],
            "out_hidden_size": shape["hidden_size"],
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": shape["fullatt"],
        },
    }
    (root / "config.json").write_text(json.dumps(config))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeat", action="store_true", help="the same image in every request")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from PIL import Image

    from asyncserve import SamplingParams
    from asyncserve.llm import LLM

    rng = np.random.default_rng(0)
    size = args.image_size

    def image(i: int) -> Any:
        seed = 0 if args.repeat else i
        data = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
        return Image.fromarray(data)

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_config(root, SHAPE_TINY if args.tiny else SHAPE_7B)
        kwargs: dict[str, Any] = {"max_model_len": 4096}
        if args.device == "cpu":
            kwargs["kv_cache_memory"] = 64 << 20
        llm = LLM(str(root), load_format="dummy", device=args.device, **kwargs)

        def prompt(i: int) -> dict[str, Any]:
            text = [int(t) for t in rng.integers(1000, 100000, size=16)]
            ids = text[:8] + [VISION_START_ID, IMAGE_TOKEN_ID, VISION_END_ID] + text[8:]
            return {"prompt_token_ids": ids, "multi_modal_data": {"image": image(i)}}

        prompts = [prompt(i) for i in range(args.requests)]
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        # Warm-up (Triton compiles) on other images, so that the cache starts without them.
        llm.generate([prompt(args.requests + i) for i in range(2)], params, use_tqdm=False)
        runner = llm.engine.runner  # type: ignore[union-attr]
        encoded_before = runner.embedder.cache.num_encoded if runner is not None else 0
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        encoded = (runner.embedder.cache.num_encoded if runner is not None else 0) - encoded_before
        ttfts = sorted(o.metrics["ttft_s"] for o in outputs if "ttft_s" in o.metrics)
        out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        result = {
            "model": "tiny" if args.tiny else "qwen2.5-vl-7b-shape (dummy)",
            "device": args.device,
            "requests": args.requests,
            "image_size": size,
            "image_tokens": (size // 28) ** 2,
            "repeat_image": args.repeat,
            "elapsed_s": round(elapsed, 3),
            "requests_per_s": round(args.requests / elapsed, 3),
            "output_tokens_per_s": round(out_tokens / elapsed, 1),
            "ttft_mean_s": round(sum(ttfts) / len(ttfts), 4) if ttfts else None,
            "ttft_p50_s": round(ttfts[len(ttfts) // 2], 4) if ttfts else None,
            "ttft_p99_s": round(ttfts[int(len(ttfts) * 0.99)], 4) if ttfts else None,
            "images_encoded": encoded,
        }
        llm.close()
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
