"""Data-parallel offline inference in vLLM's SPMD shape (examples/offline_inference/
data_parallel.py there): one process per data-parallel rank, each with its own LLM on its
own devices and its own share of the prompts.

Single node, two ranks (on GPUs, or on CPU with the default SmolLM2 model):
    python examples/data_parallel.py --dp-size 2 --tp-size 1

Two nodes of 4 ranks each (run on both, --node-rank 0 on the master):
    python examples/data_parallel.py --model M --dp-size 8 --tp-size 1 --node-size 2 \
        --node-rank 0 --master-addr 10.0.0.1 --master-port 13345

Each rank reads its place from ASYNCSERVE_DP_RANK, ASYNCSERVE_DP_SIZE,
ASYNCSERVE_DP_MASTER_IP and ASYNCSERVE_DP_MASTER_PORT; the ranks form a gloo group through
the master address, which lines up their start and their finish.
"""

from __future__ import annotations

import argparse
import os
import sys
from multiprocessing import get_context
from time import sleep


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Data-parallel inference")
    parser.add_argument("--model", default=None, help="model path (default: SmolLM2-135M)")
    parser.add_argument("--dp-size", type=int, default=2, help="data-parallel size")
    parser.add_argument("--tp-size", type=int, default=1, help="tensor-parallel size per rank")
    parser.add_argument("--node-size", type=int, default=1, help="number of nodes")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's rank")
    parser.add_argument("--master-addr", default="", help="master node's address")
    parser.add_argument("--master-port", type=int, default=0, help="master node's port")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted as vLLM's example takes it; asyncserve runs no model code from the hub",
    )
    parser.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="MoE models: whole experts on the tensor-parallel ranks of each replica",
    )
    parser.add_argument(
        "--load-format", default="auto", help="auto, or dummy for a config-only model folder"
    )
    parser.add_argument("--max-num-seqs", type=int, default=64, help="sequences per step")
    parser.add_argument("--max-model-len", type=int, default=None, help="context length")
    parser.add_argument("--timeout", type=int, default=300, help="seconds before stragglers die")
    return parser.parse_args()


def main(
    model: str | None,
    dp_size: int,
    local_dp_rank: int,
    global_dp_rank: int,
    dp_master_ip: str,
    dp_master_port: int,
    gpus_per_dp_rank: int,
    enforce_eager: bool,
    max_num_seqs: int,
    max_model_len: int | None,
    cpu_threads: int,
    enable_expert_parallel: bool = False,
    load_format: str = "auto",
) -> None:
    os.environ["ASYNCSERVE_DP_RANK"] = str(global_dp_rank)
    os.environ["ASYNCSERVE_DP_SIZE"] = str(dp_size)
    os.environ["ASYNCSERVE_DP_MASTER_IP"] = dp_master_ip
    os.environ["ASYNCSERVE_DP_MASTER_PORT"] = str(dp_master_port)

    import torch

    from asyncserve import LLM, SamplingParams

    if not torch.cuda.is_available():
        torch.set_num_threads(cpu_threads)  # the ranks share the host's cores

    # Sample prompts.
    prompts = [
        "Hello, my name is",
        "The president of the United States is",
        "The capital of France is",
        "The future of AI is",
    ] * 4

    # With DP, each rank should process different prompts: split them evenly.
    floor = len(prompts) // dp_size
    remainder = len(prompts) % dp_size

    def start(rank: int) -> int:
        return rank * floor + min(rank, remainder)

    prompts = prompts[start(global_dp_rank) : start(global_dp_rank + 1)]
    if len(prompts) == 0:
        # Every rank needs at least one prompt.
        prompts = ["Placeholder"]
    print(f"DP rank {global_dp_rank} needs to process {len(prompts)} prompts")

    # Each rank may use its own sampling parameters.
    sampling_params = SamplingParams(
        temperature=0.8, top_p=0.95, max_tokens=[16, 20][global_dp_rank % 2]
    )

    llm = LLM(
        model=model,
        tensor_parallel_size=gpus_per_dp_rank,
        enable_expert_parallel=enable_expert_parallel,
        load_format=load_format,
        enforce_eager=enforce_eager,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
    )
    outputs = llm.generate(prompts, sampling_params, use_tqdm=False)
    # Print the outputs.
    for i, output in enumerate(outputs):
        if i >= 5:
            # Print only the first 5 outputs.
            break
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"DP rank {global_dp_rank}, Prompt: {prompt!r}, Generated text: {generated_text!r}")
    llm.close()  # waits for every rank to finish
    # Give the engine a moment to pause before the process ends.
    sleep(1)


if __name__ == "__main__":
    args = parse_args()
    dp_size = args.dp_size
    tp_size = args.tp_size
    node_size = args.node_size
    node_rank = args.node_rank
    if dp_size < 1 or tp_size < 1:
        sys.exit("--dp-size and --tp-size must be >= 1")
    if dp_size % node_size != 0:
        sys.exit("--dp-size must be a multiple of --node-size")

    if node_size == 1:
        import socket

        dp_master_ip = "127.0.0.1"
        with socket.socket() as s:
            s.bind((dp_master_ip, 0))
            dp_master_port = s.getsockname()[1]
    else:
        dp_master_ip = args.master_addr
        dp_master_port = args.master_port
    dp_per_node = dp_size // node_size
    cpu_threads = max(1, (os.cpu_count() or 1) // dp_per_node)

    ctx = get_context("spawn")
    procs = []
    for local_dp_rank, global_dp_rank in enumerate(
        range(node_rank * dp_per_node, (node_rank + 1) * dp_per_node)
    ):
        # Each rank sees only its own GPUs.
        first = local_dp_rank * tp_size
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(first, first + tp_size))
        proc = ctx.Process(
            target=main,
            args=(
                args.model,
                dp_size,
                local_dp_rank,
                global_dp_rank,
                dp_master_ip,
                dp_master_port,
                tp_size,
                args.enforce_eager,
                args.max_num_seqs,
                args.max_model_len,
                cpu_threads,
                args.enable_expert_parallel,
                args.load_format,
            ),
        )
        proc.start()
        procs.append(proc)
    exit_code = 0
    for proc in procs:
        proc.join(timeout=args.timeout)
        if proc.exitcode is None:
            print(f"Killing process {proc.pid} that didn't stop within {args.timeout} s.")
            proc.kill()
            exit_code = 1
        elif proc.exitcode:
            exit_code = proc.exitcode
    sys.exit(exit_code)
