"""Offline throughput: N random prompts through LLM.generate, as vLLM's `bench throughput`.

With `--peer hf`, HF transformers' continuous-batching `generate_batch` (paged attention,
sdpa) runs the same prompts on the same weights in the same process, and the ratio is printed.
Our model takes the HF model's weights: copied in place when it runs in this process, read
from a temporary save of them by every worker under tensor parallelism.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from typing import Any

from asyncserve.bench.workload import add_parallel_arguments, output_lengths, random_prompts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model path or config dir (dummy weights)")
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", "-q", default=None, help="e.g. fp8 (as in serve)")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--input-len-max", type=int, default=None, help="uniform lengths up to this"
    )
    parser.add_argument(
        "--output-len-max", type=int, default=None, help="uniform lengths up to this"
    )
    # Unset: the LLM class's offline limits (512 / 16384 on a GPU, 256 / 2048 on CPU).
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--max-cudagraph-capture-size", type=int, default=512)
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="plan each step while the one before runs (default: on with CUDA)",
    )
    parser.add_argument("--seed", type=int, default=0)
    add_parallel_arguments(parser)
    parser.add_argument("--peer", choices=["none", "hf"], default="none")
    parser.add_argument("--output-json", default=None)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from asyncserve import SamplingParams
    from asyncserve.llm import LLM

    llm = LLM(
        model=args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        quantization=args.quantization,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        max_cudagraph_capture_size=args.max_cudagraph_capture_size,
        async_scheduling=args.async_scheduling,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        disable_custom_all_reduce=args.disable_custom_all_reduce,
        seed=args.seed,
        data_parallel_size=args.data_parallel_size,
    )
    vocab = llm.engine.loaded.arch.vocab_size
    prompts = random_prompts(args.num_prompts, args.input_len, vocab, args.seed, args.input_len_max)
    out_lens = output_lengths(args.num_prompts, args.output_len, args.seed, args.output_len_max)
    hf_model = _build_hf_peer(llm) if args.peer == "hf" else None

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in out_lens]
    # Warm-up (kernels compile, graphs capture) outside the timed region.
    llm.generate(prompts[:4], params[:4], use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_in = sum(len(p) for p in prompts)
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    report: dict[str, Any] = {
        "elapsed_s": elapsed,
        "requests_per_s": len(prompts) / elapsed,
        "total_tokens_per_s": (num_in + num_out) / elapsed,
        "output_tokens_per_s": num_out / elapsed,
        "num_prompts": len(prompts),
        "device": str(llm.engine.device),
        "tensor_parallel_size": args.tensor_parallel_size,
        "data_parallel_size": args.data_parallel_size,
    }
    print(
        f"asyncserve: {elapsed:.2f} s, {report['requests_per_s']:.2f} req/s, "
        f"{report['total_tokens_per_s']:.0f} total tok/s, "
        f"{report['output_tokens_per_s']:.0f} output tok/s"
    )
    if hf_model is not None:
        import torch  # here, so the CLI's --help does not load torch

        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        report["hf"] = _run_hf_peer(hf_model, prompts, out_lens)
        report["ratio_output_tokens"] = (
            report["output_tokens_per_s"] / report["hf"]["output_tokens_per_s"]
        )
        print(f"ratio (output tok/s, asyncserve / HF): {report['ratio_output_tokens']:.2f}x")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return report


def _build_hf_peer(llm: Any) -> Any:
    """HF model from the same config, then our model takes its weights: the same weights."""
    import transformers

    path = llm.engine.model_path
    config = transformers.AutoConfig.from_pretrained(path)
    dtype = llm.engine.loaded.dtype
    hf = transformers.AutoModelForCausalLM.from_config(
        config, dtype=dtype, attn_implementation="paged|sdpa"
    ).to(llm.engine.device)
    hf.eval()
    runner = llm.engine.runner
    if runner is not None:
        runner.model.load_weights((name, param.detach()) for name, param in hf.named_parameters())
        return hf
    # The model lives in the tensor-parallel workers: each reads its slices from disk.
    with tempfile.TemporaryDirectory(prefix="asyncserve-peer-") as tmp:
        hf.save_pretrained(tmp, safe_serialization=True)
        llm.engine.executor.collective_rpc("load_weights_from", tmp)
    return hf


def _run_hf_peer(hf: Any, prompts: list[list[int]], out_lens: list[int]) -> dict[str, Any]:
    """HF's continuous-batching manager (what generate_batch drives), with each request's
    own output length, so both engines generate the same tokens."""
    import transformers

    config = transformers.GenerationConfig(
        max_new_tokens=max(out_lens), do_sample=False, eos_token_id=-1, pad_token_id=0
    )

    def generate(batch: list[list[int]], lens: list[int]) -> int:
        with hf.continuous_batching_context_manager(
            generation_config=config, block=True, timeout=5
        ) as manager:
            for i, (prompt, n) in enumerate(zip(batch, lens, strict=True)):
                manager.add_request(input_ids=prompt, request_id=f"r{i}", max_new_tokens=n)
            done = 0
            produced = 0
            start = last_report = time.perf_counter()
            while done < len(batch):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    done += 1
                    produced += len(result.generated_tokens)
                elif result is None and not manager.is_running():
                    raise RuntimeError("HF continuous batching stopped early")
                now = time.perf_counter()
                if now - last_report >= 30:  # a long peer run shows where it is
                    last_report = now
                    print(
                        f"HF peer: {done}/{len(batch)} requests, {produced} output tokens "
                        f"after {now - start:.0f} s",
                        flush=True,
                    )
        return produced

    generate(prompts[:4], out_lens[:4])
    start = time.perf_counter()
    num_out = generate(prompts, out_lens)
    elapsed = time.perf_counter() - start
    num_in = sum(len(p) for p in prompts)
    report = {
        "elapsed_s": elapsed,
        "requests_per_s": len(prompts) / elapsed,
        "total_tokens_per_s": (num_in + num_out) / elapsed,
        "output_tokens_per_s": num_out / elapsed,
    }
    print(
        f"HF continuous batching (paged|sdpa): {elapsed:.2f} s, "
        f"{report['total_tokens_per_s']:.0f} total tok/s, "
        f"{report['output_tokens_per_s']:.0f} output tok/s"
    )
    return report
