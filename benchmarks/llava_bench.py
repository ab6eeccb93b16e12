"""LLaVA serving cost offline, asyncserve or vLLM: one image per request (576 image tokens).

    python benchmarks/llava_bench.py --engine asyncserve --output-json $OUT/llava_as.json
    python benchmarks/llava_bench.py --engine vllm --output-json $OUT/llava_vllm.json
    python benchmarks/llava_bench.py --tiny --device cpu      # a smoke run of the script

A llava-1.5-7b-shaped checkpoint (CLIP ViT-L/14 at 336 pixels, Llama-2-7B LM) with dummy
weights is written to --model-dir, with a word-level tokenizer (`<image>` = 32000), the CLIP
preprocessor config and LlavaProcessor's config, so both engines read the same files. Each of
--num-prompts requests has its own random 640 x 480 image (resized and cropped by the
processor) and --input-len random text tokens after "<image>\n".

Reported: `ttft_burst_s` (all requests at once, max_tokens 1: mean and p50 / p90 latency of
the first token when every prompt arrives together), `ttft_single_s` (one request alone,
median of --singles; with --singles-profile PATH their CUDA kernels summed per name, with
the requests' wall time, so the GPU's share of a lone request shows), and throughput with --output-len tokens per request (greedy, ignore_eos).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from side_by_side import kernel_profile  # benchmarks/ is this script's folder

IMAGE_TOKEN_ID = 32000
VOCAB = 32064


def write_checkpoint(root: Path, tiny: bool) -> None:
    root.mkdir(parents=True, exist_ok=True)
    if tiny:
        vision = {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                  "num_hidden_layers": 2, "num_attention_heads": 4, "image_size": 336,
                  "patch_size": 14, "projection_dim": 32}  # fmt: skip
        text = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
                "max_position_embeddings": 4096, "vocab_size": VOCAB}  # fmt: skip
    else:
        vision = {"model_type": "clip_vision_model", "hidden_size": 1024, "intermediate_size": 4096,
                  "num_hidden_layers": 24, "num_attention_heads": 16, "image_size": 336,
                  "patch_size": 14, "projection_dim": 768}  # fmt: skip
        text = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "vocab_size": VOCAB}  # fmt: skip
    config = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
              "image_token_index": IMAGE_TOKEN_ID, "projector_hidden_act": "gelu",
              "vision_feature_layer": -2, "vision_feature_select_strategy": "default",
              "image_seq_length": 576, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
              "vision_config": vision, "text_config": text}  # fmt: skip
    (root / "config.json").write_text(json.dumps(config, indent=2))
    (root / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "CLIPImageProcessor", "crop_size": {"height": 336, "width": 336},
        "do_center_crop": True, "do_convert_rgb": True, "do_normalize": True, "do_rescale": True,
        "do_resize": True, "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711], "resample": 3,
        "rescale_factor": 1 / 255, "size": {"shortest_edge": 336}}))  # fmt: skip
    (root / "processor_config.json").write_text(json.dumps({
        "processor_class": "LlavaProcessor", "image_token": "<image>", "patch_size": 14,
        "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1}))  # fmt: skip
    _write_tokenizer(root)


def _write_tokenizer(root: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(IMAGE_TOKEN_ID)}
    vocab.update({"<unk>": 0, "<s>": 1, "</s>": 2})
    vocab = {k: v for k, v in vocab.items() if k not in ("w0", "w1", "w2")}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken("<image>", special=True, normalized=False)])
    assert tok.token_to_id("<image>") == IMAGE_TOKEN_ID
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "model_max_length": 4096}))  # fmt: skip


def make_requests(n: int, input_len: int, seed: int = 0) -> list[dict[str, Any]]:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        image = Image.fromarray(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8))
        text = [int(t) for t in rng.integers(3, IMAGE_TOKEN_ID, input_len)]
        ids = [1, IMAGE_TOKEN_ID, *text]
        out.append({"prompt_token_ids": ids, "multi_modal_data": {"image": image}})
    return out


def make_llm(args: argparse.Namespace) -> Any:
    common = {"load_format": "dummy", "max_model_len": args.max_model_len}
    if args.engine == "asyncserve":
        from asyncserve.llm import LLM

        return LLM(args.model_dir, device=args.device, **common)
    from vllm import LLM as VLLM

    return VLLM(args.model_dir, limit_mm_per_prompt={"image": 1}, **common)


def sampling(args: argparse.Namespace, max_tokens: int) -> Any:
    if args.engine == "asyncserve":
        from asyncserve.sampling_params import SamplingParams
    else:
        from vllm import SamplingParams  # type: ignore[no-redef]
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def trace_singles(llm: Any, args: argparse.Namespace, path: str) -> None:
    """Three lone requests under the torch profiler (host ops and CUDA kernels), written as a
    gzipped Chrome trace: where a lone request's time goes, host or GPU."""
    import gzip
    import shutil

    from torch.profiler import ProfilerActivity, profile

    try:  # the engine's threads too, where torch has it
        from torch._C._profiler import _ExperimentalConfig

        config = {"experimental_config": _ExperimentalConfig(profile_all_threads=True)}
    except TypeError:
        config = {}
    requests = make_requests(3, args.input_len, seed=5)
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities, with_stack=True, **config) as prof:
        for request in requests:
            llm.generate([request], sampling(args, 1), use_tqdm=False)
    raw = path.removesuffix(".gz")
    prof.export_chrome_trace(raw)
    with open(raw, "rb") as src, gzip.open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    Path(raw).unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", choices=["asyncserve", "vllm"], default="asyncserve")
    parser.add_argument("--model-dir", default="/tmp/llava-7b-dummy")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--tiny", action="store_true", help="a tiny model of the same layout")
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--singles", type=int, default=20, help="lone requests timed")
    parser.add_argument("--singles-profile", default=None, help="PATH: their kernels (see above)")
    parser.add_argument(
        "--singles-trace",
        default=None,
        help="PATH.json.gz: a torch profiler trace (host and CUDA) of 3 more lone requests",
    )
    parser.add_argument(
        "--kernel-summary",
        default=None,
        help="PATH: the burst's CUDA kernels summed per name (side_by_side.py's table; vLLM "
        "with VLLM_ENABLE_V1_MULTIPROCESSING=0)",
    )
    args = parser.parse_args()

    write_checkpoint(Path(args.model_dir), args.tiny)
    llm = make_llm(args)
    warm = make_requests(4, args.input_len, seed=99)
    llm.generate(warm, sampling(args, 4), use_tqdm=False)

    singles: list[float] = []
    with kernel_profile(args.singles_profile, "llava single requests") as wall:
        for request in make_requests(args.singles, args.input_len, seed=1):
            start = time.perf_counter()
            llm.generate([request], sampling(args, 1), use_tqdm=False)
            singles.append(time.perf_counter() - start)
        wall.append(sum(singles))
    if args.singles_trace:
        trace_singles(llm, args, args.singles_trace)

    # A burst: every request arrives at once and produces one token; each one's latency is
    # its time to first token (asyncserve reports it per request; otherwise the batch's end).
    burst = make_requests(args.num_prompts, args.input_len, seed=2)
    with kernel_profile(args.kernel_summary, "llava burst") as wall:
        start = time.perf_counter()
        outs = llm.generate(burst, sampling(args, 1), use_tqdm=False)
        burst_s = time.perf_counter() - start
        wall.append(burst_s)
    ttfts = [o.metrics["ttft_s"] for o in outs if isinstance(getattr(o, "metrics", None), dict)
             and "ttft_s" in o.metrics]  # fmt: skip

    requests = make_requests(args.num_prompts, args.input_len, seed=3)
    start = time.perf_counter()
    outs = llm.generate(requests, sampling(args, args.output_len), use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    num_in = sum(len(o.prompt_token_ids) for o in outs)
    report: dict[str, Any] = {
        "engine": args.engine,
        "num_prompts": args.num_prompts,
        "prompt_tokens_mean": num_in / len(outs),  # 576 image tokens included
        "ttft_single_s": statistics.median(singles),
        "ttft_single_min_s": min(singles),
        "ttft_burst_all_s": burst_s,
        "elapsed_s": elapsed,
        "requests_per_s": len(outs) / elapsed,
        "output_tokens_per_s": num_out / elapsed,
        "total_tokens_per_s": (num_in + num_out) / elapsed,
    }
    if args.engine == "asyncserve":
        # The front end's share of the burst: its images preprocessed (and hashed) again.
        from asyncserve.llm_prompts import ImageWork

        start = time.perf_counter()
        work = ImageWork(llm.engine, burst)
        work.results()
        work.close()
        report["preprocess_burst_s"] = time.perf_counter() - start
    if ttfts:
        ttfts.sort()
        report["ttft_burst_mean_s"] = statistics.mean(ttfts)
        report["ttft_burst_p50_s"] = ttfts[len(ttfts) // 2]
        report["ttft_burst_p90_s"] = ttfts[int(len(ttfts) * 0.9)]
    print(json.dumps(report))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
