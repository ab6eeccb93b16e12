"""Start-up compiles on threads: launches inside the block compile (for a real sm_90
target, with Triton's own compiler and ptxas) without running, and the cache holds
compiled kernels after it.

The compile runs in a subprocess without TRITON_INTERPRET (the test session sets it for
the kernel tests); Triton's device queries are answered for an H100-class target, since
nothing here launches.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from asyncserve.kernels import parallel_compiles
from asyncserve.kernels.parallel_compiles import compile_threads, compiles_in_parallel

SCRIPT = textwrap.dedent(
    """
    import threading
    import torch
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    from asyncserve.kernels import parallel_compiles
    from asyncserve.kernels.parallel_compiles import compiles_in_parallel, compiling_only

    loaded_on = set()

    class Hopper:  # what Triton asks of the device before a launch; nothing launches
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)
        def get_current_device(self):
            return 0
        def get_current_stream(self, device):
            return 0
        def launcher_cls(self, src, metadata):  # a compiled kernel's loading starts here
            loaded_on.add(threading.current_thread().name)
            raise RuntimeError("no GPU to load onto")

    driver.set_active(Hopper())
    parallel_compiles.parallel_compiles_available = lambda device: True

    @triton.jit
    def broken(x_ptr, BLOCK: tl.constexpr):
        tl.store(x_ptr + tl.arange(0, BLOCK), 1.0)  # BLOCK 3: not a power of two

    @triton.jit
    def scale(x_ptr, y_ptr, n, BLOCK: tl.constexpr, FACTOR: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n)
        tl.store(y_ptr + offs, x * FACTOR, mask=offs < n)

    compile_threads = set()
    original_compile = triton.compile
    def recording_compile(*args, **kwargs):
        compile_threads.add(threading.current_thread().name)
        return original_compile(*args, **kwargs)

    cache_hits = []  # the parent's compiles: hits when children compiled the kernels first
    triton.knobs.compilation.listener = lambda **info: cache_hits.append(info["cache_hit"])
    do_compile_calls = []  # Triton's own _do_compile: once a variant, however often launched
    triton_do_compile = JITFunction._do_compile
    def counting_do_compile(self, key, *args):
        do_compile_calls.append(key)
        return triton_do_compile(self, key, *args)
    JITFunction._do_compile = counting_do_compile
    run_before = JITFunction.run
    x = torch.ones(1000)
    y = torch.zeros(1000)
    assert not compiling_only()
    with compiles_in_parallel(torch.device("cuda"), "a test") as active:
        assert active and compiling_only()
        kernel_cache = scale.device_caches[0][0]
        for block in (64, 128, 256, 512):
            scale[(1,)](x, y, 1000, BLOCK=block, FACTOR=3.0)  # a launch would fail here
            scale[(1,)](x, y, 1000, BLOCK=block, FACTOR=3.0)  # the same variant: one compile
        scale.compile = recording_compile
        scale[(1,)](x, y, 1000, BLOCK=1024, FACTOR=3.0)
        broken[(1,)](x, BLOCK=3)  # fails on its thread; its first real launch raises it
        broken[(1,)](x, BLOCK=3)
    assert not compiling_only()
    assert JITFunction.run is run_before
    assert JITFunction._do_compile is counting_do_compile
    assert len(do_compile_calls) == len(set(do_compile_calls)) == 6, do_compile_calls
    assert float(y.sum()) == 0.0  # nothing ran
    assert not broken.device_caches[0][0], "a failed compile left its placeholder"
    kernels = list(kernel_cache.values())
    assert len(kernels) == 5, len(kernels)
    for kernel in kernels:
        assert type(kernel).__name__ == "CompiledKernel", type(kernel)
        assert kernel.asm["cubin"] and ".target sm_90" in kernel.asm["ptx"]
    assert compile_threads and all(n.startswith("kernel-compile") for n in compile_threads)
    assert loaded_on and all(n.startswith("kernel-compile") for n in loaded_on), loaded_on
    print("ok", len(kernels), "hits", sum(cache_hits), "of", len(cache_hits))
    """
)


@pytest.mark.parametrize("fork", ["1", "0"])
def test_launches_compile_on_threads_without_running(tmp_path: Path, fork: str) -> None:
    """With ASYNCSERVE_COMPILE_FORK=1 each compile runs in a child forked from its thread
    and the thread's own compile is a hit in the disk cache the child filled; with 0 the
    threads compile."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(
        TRITON_CACHE_DIR=str(tmp_path / "cache"),
        ASYNCSERVE_COMPILE_THREADS="2",
        ASYNCSERVE_COMPILE_FORK=fork,
    )
    script = tmp_path / "compile_on_threads.py"  # Triton reads a kernel's source file
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    hits = 5 if fork == "1" else 0
    assert done.stdout.strip() == f"ok 5 hits {hits} of 5", done.stdout


def test_a_cpu_device_runs_the_block_for_real() -> None:
    with compiles_in_parallel(torch.device("cpu"), "cpu") as active:
        assert not active
        assert not parallel_compiles.compiling_only()


def test_compile_threads_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCSERVE_COMPILE_THREADS", "3")
    assert compile_threads() == 3
    monkeypatch.setenv("ASYNCSERVE_COMPILE_THREADS", "1")
    assert not parallel_compiles.parallel_compiles_available(torch.device("cuda"))
    monkeypatch.delenv("ASYNCSERVE_COMPILE_THREADS")
    assert 1 <= compile_threads() <= parallel_compiles.DEFAULT_MAX_THREADS
    for bad in ("many", "-1"):
        monkeypatch.setenv("ASYNCSERVE_COMPILE_THREADS", bad)
        with pytest.raises(ValueError, match="ASYNCSERVE_COMPILE_THREADS"):
            compile_threads()


def test_a_finished_start_up_marks_its_kernels_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start of the same signature after a finished one skips the pass; another signature,
    a start-up that never finished, or one that never skips (None) does not."""
    triton = pytest.importorskip("triton")
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))
    marker = parallel_compiles.StartUpMarker()
    assert marker.begin("llama fp16 H200") is False  # nothing there yet
    assert marker.begin("llama fp16 H200") is False  # begun, never finished
    marker.finish()
    assert [p.parent.name for p in tmp_path.rglob("*") if p.is_file()] == ["asyncserve-start-ups"]
    assert marker.begin("llama fp16 H200") is True
    assert marker.cached
    marker.finish()
    assert marker.begin("llama bf16 H200") is False
    assert marker.begin(None) is False and marker.path is None
    marker.finish()  # nothing to mark
    assert len([p for p in tmp_path.rglob("*") if p.is_file()]) == 1


def test_no_pass_when_an_earlier_start_cached_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parallel_compiles, "parallel_compiles_available", lambda device: True)
    monkeypatch.setattr(parallel_compiles.START_UP, "cached", True)
    ran: list[bool] = []
    parallel_compiles.compile_for(torch.device("cuda"), "test", lambda: ran.append(True))
    assert ran == []


def test_the_pass_waits_for_the_warm_up_threads_and_the_threads_they_start() -> None:
    # The compiler warm-up starts the driver's build on a second thread once its imports are
    # done; the start-up pass waits for both rather than doing their work again beside them.
    import threading
    import time

    finished: list[str] = []

    def driver() -> None:
        time.sleep(0.2)
        finished.append("driver")

    def compiler() -> None:
        second = threading.Thread(target=driver)
        second.start()
        parallel_compiles._warm_up_threads.append(second)
        time.sleep(0.1)
        finished.append("compiler")

    first = threading.Thread(target=compiler)
    first.start()
    parallel_compiles._warm_up_threads.append(first)
    parallel_compiles.wait_for_compiler_warm_up()
    assert sorted(finished) == ["compiler", "driver"]
    assert parallel_compiles._warm_up_threads == []


def test_compile_pass_runs_only_where_compiles_in_parallel_compiles() -> None:
    assert not parallel_compiles.compile_pass_runs(torch.device("cpu"))
