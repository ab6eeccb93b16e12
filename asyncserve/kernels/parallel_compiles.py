"""Start-up kernel compiles on a pool of threads instead of one after another.

With an empty Triton cache (a fresh machine, a new Triton or model shape) the start-up
warm-up compiles every kernel variant its forwards meet, in turn, each as its first launch
waits for it: seconds of one busy core while the others idle. Inside `compiles_in_parallel`
a forward launches no Triton kernel; each variant it meets goes to a thread pool (Triton's
AsyncCompileMode), and leaving the block waits for all of them. Each thread compiles in a
child it forks (compile_child.py: Triton builds a kernel's IR in Python, under the GIL, so
threads alone overlap only its C++ passes and ptxas), then finds the kernel in the disk
cache and loads it. The real warm-up that follows finds every kernel compiled and runs as
on a warm cache.

Such a forward still runs its torch operations and collectives (so tensor-parallel ranks
stay in step), on whatever the skipped kernels left in their outputs: values are garbage,
shapes are right. A kernel whose output becomes an index for a torch operation (the MoE
router's expert ids) fills it with valid values when `compiling_only()` says so.

On a warm cache that pass costs more than the cache hits it replaces (its forwards, and
threads contending for the GIL over hits): a start-up that finishes leaves a marker in
Triton's cache, named by what decides the kernels (engine and model configuration, GPU,
versions, the kernels' sources); a start with the same marker there skips the pass.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from asyncserve.kernels.compile_child import compile_in_child, fork_available

logger = logging.getLogger(__name__)

DEFAULT_MAX_THREADS = 16
_local = threading.local()
_patch_lock = threading.Lock()
_patch_users = 0
_original_run: Callable[..., Any] | None = None
_original_do_compile: Callable[..., Any] | None = None
# (kernel, device, specialization key) of each compile filed in a kernel cache while pending.
_placeholders: list[tuple[Any, Any, Any]] = []
# warm_up_compiler's threads, until the start-up pass waits for them.
_warm_up_threads: list[threading.Thread] = []


def compile_threads() -> int:
    """ASYNCSERVE_COMPILE_THREADS: threads compiling kernels at start-up (0 or 1: one at a
    time, in the forwards that meet them). Default: the CPU count, at most 16."""
    text = os.environ.get("ASYNCSERVE_COMPILE_THREADS")
    if not text:
        return min(os.cpu_count() or 1, DEFAULT_MAX_THREADS)
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"ASYNCSERVE_COMPILE_THREADS must be an integer, got {text!r}") from None
    if value < 0:
        raise ValueError(f"ASYNCSERVE_COMPILE_THREADS must be >= 0, got {value}")
    return value


class StartUpMarker:
    """Whether this process's start-up can skip the compile pass: an earlier start of the
    same signature finished with this Triton cache (so its kernels are on disk)."""

    def __init__(self) -> None:
        self.path: Path | None = None
        self.cached = False

    def begin(self, signature: str | None) -> bool:
        """A start-up of `signature` begins (None: one that never skips the pass); True when
        its kernels are cached already."""
        if signature is None:
            self.path, self.cached = None, False
            return False
        self.path = _triton_cache_dir() / "asyncserve-start-ups" / _digest(signature)
        self.cached = self.path.exists()
        return self.cached

    def finish(self) -> None:
        """The start-up compiled all it needed: later starts of its signature skip the pass."""
        path, self.path, self.cached = self.path, None, False
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
        except OSError as error:  # a read-only cache: later starts run the pass again
            logger.debug("cannot write the start-up marker %s: %r", path, error)


def _triton_cache_dir() -> Path:
    try:
        from triton import knobs

        return Path(knobs.cache.dir)
    except (ImportError, AttributeError):
        default = Path.home() / ".triton" / "cache"
        return Path(os.environ.get("TRITON_CACHE_DIR") or default)


def _digest(signature: str) -> str:
    import triton

    digest = hashlib.sha256(signature.encode())
    digest.update(f"triton {triton.__version__} torch {torch.__version__}".encode())
    for source in sorted(Path(__file__).parent.glob("*.py")):  # the kernels' sources
        digest.update(source.read_bytes())
    return digest.hexdigest()[:32]


# One start-up at a time per process (the runner's, up to WATCH.arm in kernel_compiles.py).
START_UP = StartUpMarker()


def compiling_only() -> bool:
    """True inside compiles_in_parallel on this thread: Triton launches are skipped."""
    return bool(getattr(_local, "active", False))


def _async_compile_mode() -> Any:
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:  # a Triton without it: kernels compile as the forwards meet them
        return None
    return AsyncCompileMode


def _patch_jit_run() -> None:
    """Make JITFunction.run a warm-up (compile, no launch) on threads that are compiling, and
    file each variant's pending compile in the kernel's cache at once: Triton 3.6 files it
    only when the compile is done (at the end of the pass), so until then every launch of it
    (each layer's, each graph size's) would pack its arguments and build its source and
    cache key again, ~0.3 ms a launch: 1.5 s of a pass over 20 graph sizes of a 32-layer
    model. Later Tritons file such a placeholder themselves."""
    global _patch_users, _original_run, _original_do_compile
    from triton.runtime.jit import JITFunction

    with _patch_lock:
        _patch_users += 1
        if _patch_users > 1:
            return
        original = JITFunction.run
        original_do_compile = JITFunction._do_compile
        _original_run, _original_do_compile = original, original_do_compile

        def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
            return original(self, *args, grid=grid, warmup=warmup or compiling_only(), **kwargs)

        def do_compile(self: Any, key: Any, signature: Any, device: Any, *args: Any) -> Any:
            kernel = original_do_compile(self, key, signature, device, *args)
            if kernel is not None and compiling_only():
                self.device_caches[device][0][key] = kernel  # a FutureKernel until the end
                _placeholders.append((self, device, key))
            return kernel

        JITFunction.run = run  # type: ignore[method-assign]
        JITFunction._do_compile = do_compile  # type: ignore[method-assign]


def _unpatch_jit_run() -> None:
    """Undo _patch_jit_run once its last user is done; a compile that failed leaves no
    placeholder behind (its first real launch compiles again and raises the error)."""
    global _patch_users, _original_run, _original_do_compile
    from triton.runtime.jit import JITFunction

    with _patch_lock:
        _patch_users -= 1
        if _patch_users == 0 and _original_run is not None:
            JITFunction.run = _original_run  # type: ignore[method-assign]
            JITFunction._do_compile = _original_do_compile  # type: ignore[method-assign]
            _original_run = _original_do_compile = None
            for fn, device, key in _placeholders:
                cache = fn.device_caches[device][0]
                if type(cache.get(key)).__name__ == "FutureKernel":
                    del cache[key]
            _placeholders.clear()


def warm_up_compiler(device: torch.device) -> None:
    """Start, on a thread of its own (while the weights load), what the first kernel compile
    or cache lookup would otherwise do on the critical path: the modules Triton's launches
    import on first use, then, at once, its CUDA driver utilities (a C module it builds with
    the host compiler into an empty cache: ~0.3 s, on a second thread) and its own cache key
    (a hash of its sources and of its compiled library, ~0.4 s: it reads the library whole).
    The start-up pass waits for them (`wait_for_compiler_warm_up`) rather than doing them
    again beside them."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return
    thread = threading.Thread(target=_warm_up_compiler, name="compiler-warm-up", daemon=True)
    thread.start()  # then listed: a thread listed is one that can be joined
    _warm_up_threads.append(thread)


def wait_for_compiler_warm_up(timeout: float = 5.0) -> None:
    """Wait for warm_up_compiler's threads (each at most `timeout` seconds)."""
    while _warm_up_threads:
        _warm_up_threads.pop().join(timeout)


def _warm_up_compiler() -> None:
    try:
        # One thread imports: two importing Triton's modules beside the main thread's own
        # imports of it can meet a lock cycle, and one gets a module half initialized.
        import triton.compiler.compiler  # noqa: F401
        import triton.experimental.gluon  # noqa: F401  (a launch's argument binder's import)
        from triton.backends.nvidia.compiler import get_ptxas_version
        from triton.runtime import driver
        from triton.runtime.cache import triton_key
    except Exception as error:  # a Triton without these: its first compile does it all
        logger.debug("compiler warm-up: %r", error)
        return
    thread = threading.Thread(
        target=_warm_up_driver, args=(driver,), name="compiler-warm-up", daemon=True
    )
    thread.start()
    _warm_up_threads.append(thread)  # before this thread ends: its waiter finds it
    try:
        triton_key()
        get_ptxas_version()
    except Exception as error:
        logger.debug("compiler warm-up: %r", error)


def _warm_up_driver(driver: Any) -> None:
    try:
        driver.active.get_current_device()
    except Exception as error:  # its first launch builds it, or raises
        logger.debug("compiler warm-up (driver): %r", error)


def _device_index(device: torch.device) -> int | None:
    """The CUDA device the kernels load onto (the caller's current one for a bare "cuda");
    None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


class _CompileAndLoad(Executor):
    """Runs each compile on the pool (`in_children`: in a child forked from the thread,
    compile_child.py, then the thread's own compile is a cache hit), then loads the kernel
    there too, onto `device_index` (a thread's current device is its own): its first launch
    would otherwise build its launcher (on an empty cache a C compile of its own, for Triton
    versions with a launcher per signature) and load it, one kernel after another."""

    def __init__(
        self, pool: ThreadPoolExecutor, device_index: int | None, in_children: bool
    ) -> None:
        self.pool = pool
        self.device_index = device_index
        self.in_children = in_children
        self.children_compiled = 0
        self._count_lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        def compile_and_load() -> Any:
            start = time.perf_counter()
            if self.in_children and compile_in_child(lambda: fn(*args, **kwargs)):
                with self._count_lock:
                    self.children_compiled += 1
            compiled = time.perf_counter()
            kernel = fn(*args, **kwargs)
            load = getattr(kernel, "_init_handles", None)
            if load is not None:
                if self.device_index is not None:
                    torch.cuda.set_device(self.device_index)
                try:
                    load()
                except Exception as error:  # its first launch tries again, and raises
                    logger.debug("loading %s after its compile: %r", kernel, error)
            logger.debug(
                "kernel %s: compiled in %.2f s, loaded in %.2f s",
                getattr(kernel, "name", kernel), compiled - start, time.perf_counter() - compiled,
            )  # fmt: skip
            return kernel

        return self.pool.submit(compile_and_load)


def parallel_compiles_available(device: torch.device) -> bool:
    return (
        device.type == "cuda"
        and compile_threads() > 1
        and os.environ.get("TRITON_INTERPRET") != "1"
        and _async_compile_mode() is not None
    )


def compile_pass_runs(device: torch.device) -> bool:
    """Whether a compiles_in_parallel block entered now would compile (not run for real)."""
    return compiling_only() or (not START_UP.cached and parallel_compiles_available(device))


@contextmanager
def compiles_in_parallel(device: torch.device, what: str) -> Iterator[bool]:
    """Inside: Triton launches on this thread compile on a thread pool instead of running.
    Yields whether that is so (False: a CPU device, ASYNCSERVE_COMPILE_THREADS <= 1, a
    Triton without AsyncCompileMode, or kernels cached by an earlier start (StartUpMarker);
    the block then runs for real and should be skipped).
    A compile that fails here is left to the real forward after, which raises it."""
    if compiling_only():  # inside another such block: its pool compiles these too
        yield True
        return
    if START_UP.cached or not parallel_compiles_available(device):
        yield False
        return
    mode_cls = _async_compile_mode()
    threads = compile_threads()
    start = time.perf_counter()
    wait_for_compiler_warm_up()
    _patch_jit_run()
    try:
        with ThreadPoolExecutor(threads, thread_name_prefix="kernel-compile") as pool:
            executor = _CompileAndLoad(pool, _device_index(device), fork_available())
            mode = mode_cls(executor, ignore_errors=True)
            with mode:
                pending = mode.future_kernels
                _local.active = True
                try:
                    yield True
                finally:
                    _local.active = False
                    count = len(pending)
                    forwards_s = time.perf_counter() - start
    finally:
        _unpatch_jit_run()
    logger.info(
        "compiled %d kernel variants for %s on %d threads (%d in forked children) in %.1f s "
        "(the forwards that met them %.1f s)",
        count, what, threads, executor.children_compiled, time.perf_counter() - start, forwards_s,
    )  # fmt: skip


def compile_for(device: torch.device, what: str, forwards: Callable[[], object]) -> None:
    """Run `forwards` once with launches skipped, compiling on threads what they meet.
    An error in that run (its inputs are garbage) is logged and left to the real run."""
    with compiles_in_parallel(device, what) as active:
        if not active:
            return
        try:
            forwards()
        except Exception as error:  # the real forward after meets it again, and raises
            logger.debug("compiling-only pass for %s stopped: %r", what, error)
    torch.cuda.synchronize(device)
