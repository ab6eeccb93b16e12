"""Does CUDA's start (driver init, context, cuBLAS) overlap the server's imports on a thread?

Times `import torch`, then the rest of the serve path's imports, then the first CUDA tensor
and GEMM on the main thread, with (`--thread`) and without a thread that starts CUDA and
cuBLAS right after `import torch`. Run each way in a fresh process (on a GPU machine).
"""

from __future__ import annotations

import argparse
import threading
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--thread", action="store_true")
    args = parser.parse_args()
    t0 = time.perf_counter()
    import torch

    t1 = time.perf_counter()
    thread = None
    if args.thread:

        def start_cuda() -> None:
            a = torch.ones(64, 64, dtype=torch.bfloat16, device="cuda")
            torch.mm(a, a)
            torch.cuda.synchronize()

        thread = threading.Thread(target=start_cuda)
        thread.start()
    import asyncserve.cli_server  # noqa: F401
    import asyncserve.engine.async_engine  # noqa: F401
    import asyncserve.http.server  # noqa: F401

    t2 = time.perf_counter()
    if thread is not None:
        thread.join()
    t3 = time.perf_counter()
    a = torch.ones(8192, 4096, dtype=torch.bfloat16, device="cuda")
    b = torch.ones(4096, 4096, dtype=torch.bfloat16, device="cuda")
    torch.mm(a, b)
    torch.cuda.synchronize()
    t4 = time.perf_counter()
    print(
        f"thread={int(args.thread)}: import torch {t1 - t0:.2f} s, the other imports "
        f"{t2 - t1:.2f} s, then waiting for the thread {t3 - t2:.2f} s, first tensor and "
        f"GEMM on the main thread {t4 - t3:.2f} s; in all {t4 - t0:.2f} s"
    )


if __name__ == "__main__":
    main()
