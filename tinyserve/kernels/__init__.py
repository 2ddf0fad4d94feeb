"""Numba kernels: the fast backend. Each kernel has a NumPy reference elsewhere in tinyserve and passes the same
tests; its docstring says what it does differently and the tolerance that follows from a different float order.

Importing this package pins down two things that otherwise cost minutes or a 10x slowdown (perf-notes):
- where compiled kernels are cached: NUMBA_CACHE_DIR defaults to <repo>/.numba_cache (kept out of git), so
  only the first process pays the tens of seconds of JIT compilation (~1 s to load from the cache);
- which thread pool runs a step: see `single_thread_blas()` and `check_threading_layer()`.
"""
from __future__ import annotations

import os
import warnings
from contextlib import contextmanager
from pathlib import Path

# Numba reads NUMBA_CACHE_DIR once, when it is first imported; set our default before that import. If some
# other module imported numba first, set its config directly: it is read when a cache=True kernel is defined.
_DEFAULT_CACHE_DIR = str(Path(__file__).resolve().parents[2] / ".numba_cache")
os.environ.setdefault("NUMBA_CACHE_DIR", _DEFAULT_CACHE_DIR)

import numba  # noqa: E402
from threadpoolctl import ThreadpoolController  # noqa: E402

if not numba.config.CACHE_DIR:
    numba.config.CACHE_DIR = _DEFAULT_CACHE_DIR

_threading_checked = False
_blas_controller: ThreadpoolController | None = None


def check_threading_layer() -> str:
    """Which threading layer Numba picked; warns loudly if it is the slow `workqueue` fallback.

    Only meaningful after the first parallel kernel has run (numba picks the layer lazily). `omp` dispatches
    a parallel loop in ~1.5 µs, `workqueue` in ~80-90 µs: at ~30 layers x a few kernels per decode step,
    that alone is several ms per token. Fix: install an OpenMP runtime (libgomp) or `tbb`.
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
    spinning after a matmul; Numba's prange then starts its own threads on the same 2 cores, and the two pools
    take turns evicting each other: a decode step measured ~10x slower (perf-notes). One pool for the hot path.
    Enter it once per step, not once per layer: entering + leaving costs ~20 µs with the controller we keep
    (threadpoolctl's plain `threadpool_limits()` rescans every loaded library: ~0.75 ms each time, measured).
    """
    global _blas_controller
    if _blas_controller is None:      # numpy (and its OpenBLAS) is loaded by now: scan the libraries once
        _blas_controller = ThreadpoolController()
    with _blas_controller.limit(limits=1, user_api="blas"):
        yield
