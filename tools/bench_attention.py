"""Paged attention: Numba kernel vs NumPy reference vs contiguous grouped attention, side by side in one run.

SmolLM2-135M shapes (N=9 query heads, K=3 KV heads, H=64), block size 16, one layer, float32. For each case
every implementation runs on the same data; we report the median of --repeats calls (after warm-up) and ratios.
  - contiguous: gqa.grouped_attention per sequence on K/V already laid out contiguously (no paging at all)
  - numpy:      paged.paged_attention (gathers each sequence's blocks into a copy, then grouped_attention)
  - numba:      kernels.attention.paged_attention_numba (walks the block table in place), run inside
                single_thread_blas() (entered once, as the engine does per step)
Then (--model) a whole decode step of the real model at context 1024 with each attention backend, with BLAS at
its default thread count and limited to 1 thread: the two-thread-pools trap, measured.

    PYTHONPATH=. python tools/bench_attention.py [--repeats 30] [--model] [--clock wall|cpu]

--clock cpu times with time.process_time (CPU seconds of all threads of this process) instead of the wall
clock. On a shared, oversubscribed machine wall-clock medians of parallel code mostly measure the OS
scheduler (a parallel loop waits for its slowest thread's next time slice); run with NUMBA_NUM_THREADS=1
OPENBLAS_NUM_THREADS=1 --clock cpu to compare the work each implementation does on one core.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
from threadpoolctl import threadpool_info

from tinyserve.gqa import grouped_attention
from tinyserve.kernels import check_threading_layer, single_thread_blas
from tinyserve.kernels.attention import paged_attention_numba
from tinyserve.measure import time_repeated
from tinyserve.paged import paged_attention, slot_mapping, write_kv

N, K, H, BS = 9, 3, 64, 16
CLOCK = time.perf_counter


def median_ms(fn, repeats: int, warmup: int = 3) -> float:
    """Median milliseconds per call of fn() on CLOCK (--clock: wall or CPU time), after `warmup` untimed calls."""
    return 1e3 * time_repeated(fn, repeats, warmup, clock=CLOCK).median


def make_case(batch: int, ctx: int, m: int, seed: int = 0):
    """`batch` sequences of `ctx` positions each (the last m new), blocks scattered over a shuffled pool."""
    rng = np.random.default_rng(seed)
    nblk = -(-ctx // BS)
    num_blocks = batch * nblk + 8
    k_cache = np.zeros((num_blocks, BS, K, H), np.float32)
    v_cache = np.zeros_like(k_cache)
    ids = rng.permutation(num_blocks)
    tables = np.full((batch, nblk), -1, np.int32)
    ks, vs = [], []
    for b in range(batch):
        tables[b] = ids[b * nblk:(b + 1) * nblk]
        k = rng.standard_normal((ctx, K, H)).astype(np.float32)
        v = rng.standard_normal((ctx, K, H)).astype(np.float32)
        write_kv(k_cache, v_cache, slot_mapping(tables[b], 0, ctx, BS), k, v)
        ks.append(k)
        vs.append(v)
    q = rng.standard_normal((batch * m, N, H)).astype(np.float32)
    args = (q, k_cache, v_cache, tables, np.full(batch, ctx), np.arange(batch + 1) * m)
    return args, ks, vs


def bench_kernels(repeats: int) -> None:
    print(f"\none layer, N={N} K={K} H={H} block_size={BS}; median of {repeats} calls, ms (ratios vs contiguous)")
    print(f"{'case':<28}{'contiguous':>11}{'numpy paged':>13}{'numba paged':>13}{'numpy/cont':>12}"
          f"{'numba/cont':>12}{'numpy/numba':>13}")
    cases = [(1, 1024, 1), (8, 1024, 1), (1, 4096, 1), (8, 4096, 1), (1, 1024, 128), (1, 512, 512)]
    for batch, ctx, m in cases:
        args, ks, vs = make_case(batch, ctx, m)
        q = args[0]

        def contiguous():
            return [grouped_attention(q[b * m:(b + 1) * m], ks[b], vs[b]) for b in range(batch)]

        np.testing.assert_allclose(paged_attention_numba(*args), np.concatenate(contiguous()), rtol=1e-4, atol=1e-5)
        t_c = median_ms(contiguous, repeats)
        t_np = median_ms(lambda: paged_attention(*args), repeats)
        with single_thread_blas():        # entered once around all calls, as the engine does once per step
            t_nb = median_ms(lambda: paged_attention_numba(*args), repeats)
        kind = "decode" if m == 1 else ("prefill" if m == ctx else f"chunk m={m}")
        name = f"B={batch} ctx={ctx} {kind}"
        print(f"{name:<28}{t_c:>11.3f}{t_np:>13.3f}{t_nb:>13.3f}{t_np / t_c:>12.2f}{t_nb / t_c:>12.2f}"
              f"{t_np / t_nb:>13.2f}")


def bench_model_step(repeats: int) -> None:
    """A decode step of SmolLM2 (30 layers) at context 1024, batch 1, K/V pool pre-filled with random values."""
    import tinyserve as ts
    from tinyserve.attention_backends import get_paged_attention
    from tinyserve.paged import KVPool

    model = ts.load_model()
    cfg, ctx = model.config, 1024
    pool = KVPool.create(cfg, num_blocks=ctx // BS + 4, block_size=BS)
    rng = np.random.default_rng(0)
    pool.k[:] = rng.standard_normal(pool.k.shape, dtype=np.float32)
    pool.v[:] = rng.standard_normal(pool.v.shape, dtype=np.float32)
    table = np.arange(ctx // BS + 4, dtype=np.int32)[::-1][None, :].copy()     # scattered: last block first
    slots = slot_mapping(table[0], ctx - 1, 1, BS)
    token, pos = np.array([42]), np.array([ctx - 1])

    def step(attn):
        def attention(layer, q, k, v):
            write_kv(pool.k[layer], pool.v[layer], slots, k, v)
            return attn(q, pool.k[layer], pool.v[layer], table, np.array([ctx]), np.array([0, 1]))
        return ts.forward(model, token, pos, attention)

    blas_threads = [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
    print(f"\nwhole decode step, SmolLM2-135M, batch 1, context {ctx}; median of {repeats} steps, ms "
          f"(BLAS default threads: {blas_threads}, numba threads: {os.environ.get('NUMBA_NUM_THREADS', 'all')})")
    results = {}
    for backend in ("numpy", "numba"):
        attn = get_paged_attention(backend)
        results[backend, "default"] = median_ms(lambda: step(attn), repeats)

        def step_blas1():
            with single_thread_blas():
                return step(attn)
        results[backend, "1"] = median_ms(step_blas1, repeats)
    for (backend, blas), t in results.items():
        print(f"  attention={backend:<6} BLAS threads={blas:<8} {t:8.2f} ms")
    print(f"  numba backend: default BLAS / single-thread BLAS = "
          f"{results['numba', 'default'] / results['numba', '1']:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--model", action="store_true", help="also time whole decode steps of the real model")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    ap.add_argument("--model-only", action="store_true", help="skip the one-layer table")
    a = ap.parse_args()
    global CLOCK
    CLOCK = time.perf_counter if a.clock == "wall" else time.process_time
    print(f"clock: {a.clock}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; "
          f"NUMBA_NUM_THREADS={os.environ.get('NUMBA_NUM_THREADS', 'default')} "
          f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'default')}")
    if not a.model_only:
        bench_kernels(a.repeats)
        print(f"numba threading layer: {check_threading_layer()}")
    if a.model or a.model_only:
        bench_model_step(max(5, a.repeats // 3))


if __name__ == "__main__":
    main()
