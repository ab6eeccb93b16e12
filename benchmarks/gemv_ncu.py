"""One launch of each decode GEMV on Llama-3-8B's gate_up shape (28672 x 4096, one token), for
Nsight Compute: the int4 GEMV (group 128) and the FP8 GEMV, at their default tiles or at the
depth --stages gives. Run it under ncu, e.g.

  ncu --kernel-name regex:gemv_kernel --launch-skip 2 --launch-count 2 \
      --section SpeedOfLight --section WarpStateStats --section Occupancy \
      python benchmarks/gemv_ncu.py

Each kernel runs three times (the first compiles; ncu's --launch-skip 2 takes the third of
the int4 GEMV and the first of the FP8 one after it).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncserve.kernels import quant_reference as reference  # noqa: E402
from asyncserve.kernels.fp8_gemm import per_token_group_quant_fp8  # noqa: E402
from asyncserve.kernels.fp8_gemv import fp8_gemv, fp8_gemv_config  # noqa: E402
from asyncserve.kernels.int4_gemv import gemv_config, int4_gemv  # noqa: E402
from asyncserve.kernels.split_k import sm_count  # noqa: E402

N, K, GROUP = 28672, 4096, 128


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--stages", type=int, default=0, help="loop depth (0: the default)")
    args = parser.parse_args()
    cuda = torch.device("cuda")
    sms = sm_count(cuda)
    values = torch.randint(0, 16, (N, K), device=cuda)
    qweight = reference.pack_int4(values)
    scales = (torch.rand(N, K // GROUP, device=cuda) * 0.02).bfloat16()
    zeros = torch.randint(0, 16, (N, K // GROUP), device=cuda).bfloat16()
    x = torch.randn(1, K, device=cuda, dtype=torch.bfloat16)
    config = gemv_config(N, K, GROUP, False, sms)
    if args.stages:
        config = dataclasses.replace(config, num_stages=args.stages)
    print("int4", config, flush=True)
    for _ in range(3):
        int4_gemv(x, qweight, scales, zeros, None, GROUP, config)
    w_q = torch.randn(N, K, device=cuda).to(reference.FP8_DTYPE)
    w_s = torch.rand(N, device=cuda) * 0.01
    x_q, x_s = per_token_group_quant_fp8(x.float(), K)
    fp8_config = fp8_gemv_config(N, K, sms)
    if args.stages:
        fp8_config = dataclasses.replace(fp8_config, num_stages=args.stages)
    print("fp8", fp8_config, flush=True)
    for _ in range(3):
        fp8_gemv(x_q, w_q, x_s, w_s, torch.bfloat16, None, fp8_config)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
