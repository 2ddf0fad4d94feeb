"""Numba kernels: the fast backend. Each kernel has a NumPy reference elsewhere in tinyserve and passes the same
tests; its docstring says what it does differently and the tolerance that follows from a different float order.

Importing this package pins down what otherwise costs minutes of compiling, a many-fold slowdown or wrong code:
- which instruction set the kernels are built for (kernels/isa.py: the CPU's best, or TINYSERVE_KERNELS);
- where compiled kernels are cached: NUMBA_CACHE_DIR defaults to <repo>/.numba_cache (kept out of git), one
  folder per instruction set inside it, so only the first process pays for the JIT compilation (the others load
  the cached kernels) and a forced variant never loads another's kernels;
- which thread pool runs a step: see `single_thread_blas()` and `check_threading_layer()`;
- how long an idle OpenMP worker spins before it sleeps (GOMP_SPINCOUNT, below).
The measurements behind each choice: docs/performance.md, "Why the kernels' constants are what they are".
"""
from __future__ import annotations

import hashlib
import os
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path

# Numba reads its NUMBA_* variables when it is imported (and again whenever one of them changes), so they are set
# here, before that import, and kept in os.environ. A process we start inherits them: a cache folder that already
# names a variant is taken back to its root, and CPU features we pinned for a forced variant are dropped before
# the child pins its own.
from . import isa  # noqa: E402  (llvmlite only: numba is not imported yet)

_root = Path(os.environ.get("NUMBA_CACHE_DIR") or Path(__file__).resolve().parents[2] / ".numba_cache")
if _root.name.split("-")[0] in isa.VARIANTS:
    _root = _root.parent
# Numba re-compiles a cached kernel when its own file changes, not when a function it calls from another file does
# (a tile in int8_dot.py inlined into matmul.py's loops): the folder's name carries a hash of every kernel source,
# so an edited kernel is never served stale
_sources = hashlib.sha1(b"".join(p.read_bytes() for p in sorted(Path(__file__).parent.glob("*.py")))).hexdigest()
os.environ["NUMBA_CACHE_DIR"] = CACHE_DIR = str(_root / f"{isa.NAME}-{_sources[:10]}")
if os.environ.get("NUMBA_CPU_FEATURES") and os.environ.get("NUMBA_CPU_FEATURES") == os.environ.get("TINYSERVE_PINNED_FEATURES"):
    del os.environ["NUMBA_CPU_FEATURES"]
if isa.FORCED_FEATURES is not None:          # a variant below this CPU's: compile for exactly its features
    os.environ["NUMBA_CPU_FEATURES"] = os.environ["TINYSERVE_PINNED_FEATURES"] = isa.FORCED_FEATURES

# libgomp's workers (Numba's `omp` layer) spin after each parallel loop, by default 300,000 turns of `pause`,
# before they sleep. Alone on the machine that is harmless; beside another busy program (a second engine, a test
# run, a browser) the spinning workers take the cores the other side's threads need, and both collapse. A tenth of
# the default still outlasts the Python between two batch-1 decode steps, so the worker is awake when the next step
# starts instead of being woken each step, and it sleeps long before another program's threads need the core.
# libgomp reads it when it is loaded (Numba's first parallel loop); a value you set yourself is kept.
if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "30000"

import numba  # noqa: E402
from threadpoolctl import ThreadpoolController  # noqa: E402

numba.config.reload_config()                 # (if numba was imported before us, it takes the variables now)

_threading_checked = False
_blas_libraries: list | None = None   # threadpoolctl's controllers of the BLAS libraries NumPy loaded
_blas_held = threading.local()        # .depth: 1 inside single_thread_blas() on this thread


def check_threading_layer() -> str:
    """Which threading layer Numba picked; warns loudly if it is the slow `workqueue` fallback.

    Only meaningful after the first parallel kernel has run (numba picks the layer lazily). `workqueue` dispatches
    a parallel loop tens of times slower than `omp`, and a decode step runs a few parallel loops per layer, so the
    dispatch alone outweighs the step's arithmetic. Fix: install an OpenMP runtime (libgomp) or `tbb`.
    """
    global _threading_checked
    layer = numba.threading_layer()
    if layer == "workqueue" and not _threading_checked:
        warnings.warn("\n" + "!" * 78 + "\nNumba is using the 'workqueue' threading layer: every parallel kernel "
                      "call costs ~80 µs instead of ~1.5 µs.\nInstall libgomp (OpenMP) or the `tbb` package so "
                      "numba can use 'omp' or 'tbb'.\n" + "!" * 78, RuntimeWarning, stacklevel=2)
    _threading_checked = True
    return layer


@contextmanager
def single_thread_blas():
    """Run the block with NumPy's BLAS (OpenBLAS) limited to one thread.

    Use it around every engine step when the numba backend is active. OpenBLAS keeps its own pthreads
    spinning after a matmul; Numba's prange then starts its own threads on the same cores, and the two pools take
    turns evicting each other: a decode step runs many times slower. One pool for the hot path.
    Enter it once per step, not once per layer. The BLAS libraries are found once (threadpoolctl's
    `threadpool_limits()` rescans every loaded library each time, which costs more than a small step's Python);
    after that, entering and leaving asks each library its thread count and sets it only if it is not 1 already, a
    few calls where threadpoolctl's `limit()` on a kept controller runs through its bookkeeping.
    """
    global _blas_libraries
    if getattr(_blas_held, "depth", 0):   # nested in this thread (the engine's step around the forward's): on already
        yield
        return
    if _blas_libraries is None:      # numpy (and its OpenBLAS) is loaded by now: find the libraries once
        _blas_libraries = ThreadpoolController().select(user_api="blas").lib_controllers
    before = [lib.get_num_threads() for lib in _blas_libraries]    # (None: a library that cannot say)
    for lib, n in zip(_blas_libraries, before):
        if n != 1:
            lib.set_num_threads(1)
    _blas_held.depth = 1
    try:
        yield
    finally:
        _blas_held.depth = 0
        for lib, n in zip(_blas_libraries, before):
            if n is not None and n != 1:
                lib.set_num_threads(n)
