"""Fixed benchmark inputs: random token-id prompts and output lengths from a seed."""

from __future__ import annotations

import argparse
import random


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine's parallelism flags, named as serve names them."""
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=1, help="engine replicas")
    parser.add_argument("--enable-expert-parallel", action="store_true")
    parser.add_argument("--disable-custom-all-reduce", action="store_true")


def random_prompts(
    num_prompts: int,
    input_len: int,
    vocab_size: int,
    seed: int = 0,
    input_len_max: int | None = None,
) -> list[list[int]]:
    """Prompts of random token ids; lengths uniform in [input_len, input_len_max] when given."""
    rng = random.Random(seed)
    # Skip the low ids, where special tokens usually sit.
    low = min(1000, vocab_size // 4)
    prompts = []
    for _ in range(num_prompts):
        n = input_len if input_len_max is None else rng.randint(input_len, input_len_max)
        prompts.append([rng.randrange(low, vocab_size) for _ in range(n)])
    return prompts


def output_lengths(
    num_prompts: int, output_len: int, seed: int = 0, output_len_max: int | None = None
) -> list[int]:
    rng = random.Random(seed + 1)
    if output_len_max is None:
        return [output_len] * num_prompts
    return [rng.randint(output_len, output_len_max) for _ in range(num_prompts)]
