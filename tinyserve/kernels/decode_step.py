"""A whole decode step in one Numba call: every layer, attention included, two threads meeting at spin barriers.

Why. At batch 1 a decode step should cost what it takes to read the weights once (roofline.py: the weights' bytes
over the memory bandwidth). The three fused calls per layer (kernels/layer.py) stream each matrix at full speed, yet
the step costs far more than that: a parallel loop starts and joins for every matmul, Python runs between them, and
while one thread does the serial bits (a norm, RoPE, attention, a Python call) the memory system idles, so every
matrix starts its stream cold. The same matmuls in one call whose threads meet at barriers keep the memory busy
(lesson 7 measures the three ways; docs/performance.md, "Why the kernels' constants are what they are").

How. `_decode_step_kernel` starts n threads once (`prange(n)`, one iteration per thread under OpenMP); each runs
`_thread_step`: the whole forward, doing its share of each step and waiting for the others where the next step
needs every thread's results (kernels/spin.py):

    per layer                                                   who does it
    RMSNorm (+ quantise) of every row                            every thread, for itself (cheaper than a barrier);
                                                                 from SPLIT_ROWS rows a thread: thread i its share
                                                                 of the rows, then a barrier (likewise the
                                                                 quantisation of a, the norm of x, SwiGLU)
    [Q|K|V] = h @ Wqkv                                           thread i: output blocks [i/n, (i+1)/n) of the matrix
    --- barrier ---
    RoPE, write K/V to the cache slot                            work items (row, head), dealt round robin
    --- barrier ---
    attention over the cache                                     the (row, query head) pairs, split evenly
    --- barrier ---
    x += a @ Wo                                                  output blocks split as above (each x column has
    --- barrier ---                                              one writer)
    gu = RMSNorm(x) @ [Wgate | Wup]                               norm: every thread; matmul: split
    --- barrier ---
    x += swiglu(gu) @ Wdown                                      swiglu: every thread; matmul: split
    --- barrier ---
    logits = RMSNorm(x) @ W_head                                  split (the join of prange ends the step)

Which steps. Steps of up to MAX_ROWS rows that all need logits (decode rows, the k + 1 rows of a speculative
verify), whose K/V live where a `KVLayout` says (one entry per row: kv_cache.forward_with_cache and the Engine pass
one to model.forward when they use the default attention). Every row's K/V is written before any row attends:
a verify's rows are one sequence and read each other's K/V, and a KV head's query heads may be split between
threads (9 heads on 2 threads: 5 and 4, where whole KV heads would be 2 and 1, a third of the attention idle).
Each thread asks for the K/V rows its heads will read at the start of the layer (`_prefetch_kv`), so they arrive
while the Q|K|V matmul runs. Its row j gets the logits a
decode step at that position would get, bit for bit in W8A8 (tests/test_decode_step.py). Anything else (prefill
chunks, custom attention, more rows) takes the three-call path.

Same numbers? The matmuls, norms and attention are the three-call path's own code (kernels/matmul.py, layer.py,
attention.py: decode_attention_item), and SiLU uses fast_exp.exp32 on both. So W8A32 agrees with the three-call path
to ~1e-6, and W8A8 bit for bit (tests/test_decode_step.py). With NumPy's exp on the three-call side (forward.silu_exp
= np.exp, which makes it the NumPy reference's bits), W8A8 drifts the way any float difference makes it drift (an
activation tipped into the next int8 step), and is as accurate as the reference (tests/test_quant_accuracy.py).
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import NamedTuple, Union

import numba
import numpy as np
from numba import njit, prange

from ..attention_backends import KVLayout
from ..quant import is_w8a8
from .attention import decode_attention_heads, decode_scratch
from .layer import _rms_norm_quant_row, _rms_norm_row, _swiglu_row
from .simd import prefetch_l2
from .matmul import (BLOCK, COLS, ROWS, B8A8Weights, Q5A8Weights, Q6A8Weights, S4A8Weights, S5A8Weights, S8A8Weights,
                     W4A8Weights, W8A8Weights, W8A32Weights, _layer, _quantize_row, matmul_blocks, rope_head,
                     thread_share)
from .spin import FAILED, SYNC_SIZE, TIMEOUT_CYCLES, barrier, regions_can_run

# rows per fused step: four weight tiles' worth (matmul.ROWS = 4 rows a tile), so that decode at batch 16 and a
# speculative verify of k <= 15 drafts (k + 1 rows) run fused. The fused step's lead over the three-call path shrinks
# with the rows (every thread norms and quantises every row for itself) and is level at 16 rows on a quiet machine;
# but the three-call path starts a parallel loop for every matmul, and when another program holds one of the cores
# each of them waits for it, so on a shared machine the fused step keeps its lead up to here.
MAX_ROWS = 4 * ROWS

# The K/V lines a thread asks into L2 at the start of a layer, for its first attention heads: a fraction of a
# core's L2, so the weights streaming past do not evict them; each head's attention asks for the next one's as it
# starts (_attend_heads).
PREFETCH_LINES = 256 * 1024 // 64

# From this many rows per thread on, the threads split the norms, SwiGLU and quantisation between them by rows (a
# barrier a matmul more); below it every thread makes every row's inputs for itself.
SPLIT_ROWS = 4

# one packed matrix, its class its kind
Packed = Union[W8A8Weights, W8A32Weights, W4A8Weights, S4A8Weights, Q6A8Weights, B8A8Weights, S8A8Weights,
               Q5A8Weights, S5A8Weights]


class PackedLayer(NamedTuple):
    """One layer's weights as the kernels take them; each matrix is its packed kind (matmul.W8A8Weights,
    W8A32Weights, W4A8Weights, S4A8Weights, Q6A8Weights, B8A8Weights, S8A8Weights, Q5A8Weights or S5A8Weights),
    Q|K|V and gate|up fused. With a leading L axis on every array, the same class
    holds every layer at once (DecodeWeights.layers)."""
    attn_norm: np.ndarray  # [D]
    qkv: Packed            # [D, (N + 2K) H]
    o: Packed              # [N H, D]
    mlp_norm: np.ndarray   # [D]
    gate_up: Packed        # [D, 2F]
    down: Packed           # [F, D]


class DecodeWeights(NamedTuple):
    """Everything the fused decode step reads (forward.prepare packs it once): one call walks every layer."""
    layers: PackedLayer    # every array [L, ...]: the layers' weights stacked
    final_norm: np.ndarray  # [D]
    lm_head: Packed        # [D, V]


class StepThreads(NamedTuple):
    """The threads of one step and where they meet (kernels/spin.py)."""
    n: int                 # threads: one iteration of the parallel loop each
    sync: np.ndarray       # [SYNC_SIZE] int64, zeroed: the barrier's counters, and FAILED if one timed out
    timeout: int           # cycles a thread waits at a barrier before the step gives up


class StepRows(NamedTuple):
    """The step's rows as the layers take them in."""
    x: np.ndarray          # [T, D] float32: the rows' embeddings, then their residual stream (updated in place)
    cos: np.ndarray        # [T, H/2] float32: RoPE at each row's position
    sin: np.ndarray        # [T, H/2]
    eps: np.float32        # RMSNorm's epsilon
    n_heads: int           # N (K and H come from the cache's shape)
    w8a8: bool             # int8 activations (W8A8, W4A8) or float32 ones (W8A32)


class KVView(NamedTuple):
    """attention_backends.KVLayout as the kernel takes it: where each row's K/V live."""
    k: np.ndarray             # [L, num_slots, K, H] float32
    v: np.ndarray             # [L, num_slots, K, H]
    block_tables: np.ndarray  # [T, max_blocks] int64: row t's sequence's block table
    block_size: int
    context_lens: np.ndarray  # [T] int64: the positions row t attends to, its own the last


class Shared(NamedTuple):
    """The buffers every thread of a step reads and writes (each element has one writer between two barriers)."""
    qkv: np.ndarray        # [T, (N + 2K) H] float32
    q: np.ndarray          # [T, N, H]: roped queries
    a: np.ndarray          # [T, N, H]: attention's output
    gu: np.ndarray         # [T, 2F]: gate | up
    logits: np.ndarray     # [T, V]
    # the matmuls' inputs, normed / quantised, when the threads split the rows between them (_thread_step)
    h: np.ndarray          # [T, D] float32: RMSNorm(x) (W8A32)
    act: np.ndarray        # [T, F] float32: swiglu(gu)
    xu: np.ndarray         # [T, D] uint8: RMSNorm(x) quantised (int8 activations)
    au: np.ndarray         # [T, F] uint8: swiglu(gu) quantised
    ou: np.ndarray         # [T, N H] uint8: attention's output quantised
    sx: np.ndarray         # [T, nb] float32: xu's scales (nb per row: the matrix's activation blocks)
    so: np.ndarray         # [T, nb]: ou's
    sd: np.ndarray         # [T, nb]: au's


@njit(cache=True)
def _norm_rows(w8a8, x, weight, eps, h, xu, sx, lo, hi):
    """RMSNorm of rows lo .. hi of x: into h (W8A32) or quantised into xu, sx (W8A8)."""
    for t in range(lo, hi):
        if w8a8:
            _rms_norm_quant_row(x, t, weight, eps, xu, sx)
        else:
            _rms_norm_row(x, t, weight, eps, h)


@njit(cache=True)
def _attend_heads(q, k_rows, v_rows, block_tables, bs, context_lens, lo, hi, a, fs, ints):
    """Attention for the (row, query head) pairs lo .. hi of the T * N, row-major: the runs of them that share a KV
    head go to decode_attention_heads together (each K/V row read once per run). fs, ints: this thread's
    attention.decode_scratch."""
    N, g = q.shape[1], q.shape[1] // k_rows.shape[1]
    h = lo
    while h < hi:
        t, kh, r = h // N, h % N // g, h % g
        r_end = min(g, r + hi - h)
        nxt = h + r_end - r                      # the next run's K/V on its way while this one computes
        nb, nkh = (nxt // N, nxt % N // g) if nxt < hi else (-1, 0)
        decode_attention_heads(q, k_rows, v_rows, block_tables, bs, context_lens, t, kh, r, r_end, a, fs, ints,
                               nb, nkh)
        h += r_end - r


@njit(cache=True)
def _prefetch_kv(k_rows, v_rows, block_tables, bs, context_lens, N, lo, hi, max_lines):
    """Ask into L2 the K and V rows that this thread's attention heads lo .. hi will read (every position but the
    new one, which RoPE writes), before the layer's first matmul: by the attention they have arrived. (Every step
    streams all the weights through the caches, so the K/V of the last step are long gone; read on demand they
    cost the attention a multiple of its warm time.)"""
    K, H = k_rows.shape[1], k_rows.shape[2]
    g = N // K
    kf, vf = k_rows.reshape(-1), v_rows.reshape(-1)
    line = 64 // k_rows.itemsize
    last = -1                                                   # the (row, KV head) done last
    for h in range(lo, hi):
        t, kh = h // N, h % N // g
        if t * K + kh == last:
            continue
        last = t * K + kh
        for blk in range((context_lens[t] - 1 + bs - 1) // bs):     # block by block: no division per position
            first = block_tables[t, blk] * bs
            for j in range(min(bs, context_lens[t] - 1 - blk * bs)):
                base = ((first + j) * K + kh) * H
                for d in range(0, H, line):
                    prefetch_l2(kf, base + d)
                    prefetch_l2(vf, base + d)
                max_lines -= 2 * ((H + line - 1) // line)
                if max_lines <= 0:
                    return


@njit(cache=True)
def _share(wt, h, xu, sx, out, accumulate, tid, n_threads, acc):
    """Thread tid's share of out (+)= input @ wt: its output blocks (matmul.thread_share); the weights' kind reads
    h (W8A32) or xu, sx (int8 activations)."""
    lo, hi = thread_share(wt.w.shape[0], tid, n_threads)
    matmul_blocks(wt, h, xu, sx, out, accumulate, lo, hi, acc)


@njit(cache=True, error_model="numpy")   # SiLU's divisions vectorise (see layer.SWIGLU_KERNEL)
def _thread_step(tid, threads, rows, weights, kv, shared):
    """One thread's part of the decode step (see the module docstring); returns early if a barrier fails.
    threads: StepThreads; rows: StepRows; weights: DecodeWeights (the layers' arrays stacked [L, ...]); kv: KVView;
    shared: Shared, the buffers all threads write (every element has one writer between two barriers)."""
    n_threads, sync, timeout = threads.n, threads.sync, threads.timeout
    x, cos, sin, eps, w8a8 = rows.x, rows.cos, rows.sin, rows.eps, rows.w8a8
    k_pool, v_pool, block_tables, bs, context_lens = kv.k, kv.v, kv.block_tables, kv.block_size, kv.context_lens
    qkv, q, a, gu, logits = shared.qkv, shared.q, shared.a, shared.gu, shared.logits
    lw = weights.layers
    T, D = x.shape
    L, K, H = k_pool.shape[0], k_pool.shape[2], k_pool.shape[3]
    N = q.shape[1]
    g = N // K
    F = gu.shape[1] // 2
    # The normed / quantised input of the next matmul. Few rows: each thread makes all of it for itself, in its own
    # buffers (cheaper than a barrier). From SPLIT_ROWS rows a thread on: each makes its share of the rows into the
    # shared ones (`shared`, made by _step_threads), and a barrier waits for the rest. Same arithmetic per row
    # either way.
    split = T >= SPLIT_ROWS * n_threads and n_threads > 1
    if split:
        h, act, xu, au, ou = shared.h, shared.act, shared.xu, shared.au, shared.ou
        sx, so, sd = shared.sx, shared.so, shared.sd
        rows_lo, rows_hi = thread_share(T, tid, n_threads)
    else:
        h, act = np.empty((T, D), np.float32), np.empty((T, F), np.float32)
        xu, au, ou = np.empty((T, D), np.uint8), np.empty((T, F), np.uint8), np.empty((T, N * H), np.uint8)
        sx, so, sd = (np.empty_like(shared.sx), np.empty_like(shared.so), np.empty_like(shared.sd))
        rows_lo, rows_hi = 0, T
    acc = np.empty(ROWS * COLS * BLOCK, np.float32)              # a tile's scratch (every kind's tiles: float32)
    att_f, att_i = decode_scratch(g, H)                          # attention's scratch
    heads_lo, heads_hi = thread_share(T * N, tid, n_threads)    # this thread's (row, query head) pairs
    for layer in range(L):
        _prefetch_kv(k_pool[layer], v_pool[layer], block_tables, bs, context_lens, N, heads_lo, heads_hi,
                     PREFETCH_LINES)
        # [Q|K|V] = RMSNorm(x) @ Wqkv
        _norm_rows(w8a8, x, lw.attn_norm[layer], eps, h, xu, sx, rows_lo, rows_hi)
        if split and not barrier(sync, n_threads, timeout):
            return
        _share(_layer(lw.qkv, layer), h, xu, sx, qkv, False, tid, n_threads, acc)
        if not barrier(sync, n_threads, timeout):
            return
        # RoPE and K/V into the cache, then attention: items (row t, head), dealt round robin; heads 0 .. N-1 are
        # the query heads, N .. N+K-1 the KV heads (K roped into the row's cache slot, V copied there)
        k_rows, v_rows = k_pool[layer], v_pool[layer]
        for item in range(tid, T * (N + K), n_threads):
            t, head = item // (N + K), item % (N + K)
            if head < N:
                rope_head(qkv[t], head * H, cos[t], sin[t], q[t, head])
                continue
            kh = head - N
            pos = context_lens[t] - 1                               # this row's position: the last of its context
            slot = block_tables[t, pos // bs] * bs + pos % bs
            rope_head(qkv[t], (N + kh) * H, cos[t], sin[t], k_rows[slot, kh])
            for d in range(H):
                v_rows[slot, kh, d] = qkv[t, (N + K + kh) * H + d]
        if not barrier(sync, n_threads, timeout):                   # the rows of a verify step (one sequence)
            return                                                  # read each other's K/V: all written first
        _attend_heads(q, k_rows, v_rows, block_tables, bs, context_lens, heads_lo, heads_hi, a, att_f, att_i)
        if not barrier(sync, n_threads, timeout):
            return
        # x += a @ Wo
        a2 = a.reshape(T, N * H)
        if w8a8:
            for t in range(rows_lo, rows_hi):
                _quantize_row(a2[t], ou[t], so[t])
            if split and not barrier(sync, n_threads, timeout):
                return
        _share(_layer(lw.o, layer), a2, ou, so, x, True, tid, n_threads, acc)
        if not barrier(sync, n_threads, timeout):
            return
        # gu = RMSNorm(x) @ [Wgate | Wup]
        _norm_rows(w8a8, x, lw.mlp_norm[layer], eps, h, xu, sx, rows_lo, rows_hi)
        if split and not barrier(sync, n_threads, timeout):
            return
        _share(_layer(lw.gate_up, layer), h, xu, sx, gu, False, tid, n_threads, acc)
        if not barrier(sync, n_threads, timeout):
            return
        # x += (silu(gate) * up) @ Wdown
        for t in range(rows_lo, rows_hi):
            _swiglu_row(gu, t, act)
            if w8a8:
                _quantize_row(act[t], au[t], sd[t])
        if split and not barrier(sync, n_threads, timeout):
            return
        _share(_layer(lw.down, layer), act, au, sd, x, True, tid, n_threads, acc)
        if not barrier(sync, n_threads, timeout):
            return
    _norm_rows(w8a8, x, weights.final_norm, eps, h, xu, sx, rows_lo, rows_hi)
    if split and not barrier(sync, n_threads, timeout):
        return
    _share(weights.lm_head, h, xu, sx, logits, False, tid, n_threads, acc)


@njit(cache=True, parallel=True)
def _step_threads(threads, rows, kv, logits, attn_norm, wqkv, wo, mlp_norm, wgu, wdown, final_norm, lm_head):
    """The threads of one step. A parallel loop takes a named tuple into its body only if the tuple holds no tuples
    itself: the flat ones (threads, rows, kv, Shared, each packed matrix) pass as they are, DecodeWeights as its
    parts (_decode_step_kernel unpacks it), put together again inside the loop, once per thread."""
    T, K, H = rows.x.shape[0], kv.k.shape[2], kv.k.shape[3]
    N = rows.n_heads
    D, F, NH = rows.x.shape[1], wgu.w.shape[1] * BLOCK // 2, N * H
    # the activation scales: nb per row of each matrix's input (int8 kinds' blocks [L, nb, 0]; W8A32: unused)
    shared = Shared(np.empty((T, (N + 2 * K) * H), np.float32), np.empty((T, N, H), np.float32),
                    np.empty((T, N, H), np.float32), np.empty((T, wgu.w.shape[1] * BLOCK), np.float32), logits,
                    np.empty((T, D), np.float32), np.empty((T, F), np.float32), np.empty((T, D), np.uint8),
                    np.empty((T, F), np.uint8), np.empty((T, NH), np.uint8),
                    np.empty((T, wqkv.blocks.shape[1]), np.float32), np.empty((T, wo.blocks.shape[1]), np.float32),
                    np.empty((T, wdown.blocks.shape[1]), np.float32))
    for tid in prange(threads.n):                  # one iteration per thread: the threads start once per step
        weights = DecodeWeights(PackedLayer(attn_norm, wqkv, wo, mlp_norm, wgu, wdown), final_norm, lm_head)
        # (tid is unsigned in the loop Numba generates and signed where it types the body: one type, one compile)
        _thread_step(np.int64(tid), threads, rows, weights, kv, shared)


@njit(cache=True)
def _decode_step_kernel(threads, rows, weights, kv, logits):
    """The fused decode step: logits [T, V] of the rows (StepRows) through every layer of `weights`
    (DecodeWeights), their K/V written where `kv` (KVView) says, by `threads` (StepThreads)."""
    lw = weights.layers
    _step_threads(threads, rows, kv, logits, lw.attn_norm, lw.qkv, lw.o, lw.mlp_norm, lw.gate_up, lw.down,
                  weights.final_norm, weights.lm_head)


_KERNEL = _decode_step_kernel            # the compiled one (a test or lesson 7's timer may put a stand-in in its place)


def _type_key(value) -> object:
    """What Numba's type of an argument depends on (numba.typeof: an array's dtype, dimensions, layout and
    writability; a scalar's type; a named tuple's class and fields), read without typing it."""
    if isinstance(value, np.ndarray):
        f = value.flags
        return type(value), value.dtype.str, value.ndim, f.c_contiguous, f.f_contiguous, f.writeable
    if isinstance(value, tuple):
        return type(value), *map(_type_key, value)
    return type(value)


def _run_kernel(fw, threads: StepThreads, rows: StepRows, kv: KVView, logits: np.ndarray) -> None:
    """_decode_step_kernel(threads, rows, fw.decode, kv, logits). Numba's dispatcher types every named tuple of a
    call in Python, which costs a visible share of a batch-1 step; so the first call of each argument type goes
    through it (compiling or loading the kernel) and the compiled entry point it picked is kept on the model's
    FastWeights, keyed by what the types depend on (_type_key; the weights' types are the model's own)."""
    args = (threads, rows, fw.decode, kv, logits)
    if _decode_step_kernel is not _KERNEL:
        _decode_step_kernel(*args)
        return
    key = (_type_key(threads), _type_key(rows), _type_key(kv), _type_key(logits))
    entry = fw.decode_entries.get(key)
    if entry is not None:
        entry(*args)
        return
    _KERNEL(*args)
    fw.decode_entries[key] = _KERNEL.overloads[tuple(map(_KERNEL.typeof_pyval, args))].entry_point


_disabled_reason: str | None = None      # set when a step failed: every later step takes the three-call path
_switched_off = False                    # inside `three_call_path()`
threads = numba.get_num_threads          # how many threads a step starts (a test makes it lie)


@contextmanager
def three_call_path():
    """Within the block, decode steps take the three-call path: lesson 7 and the tests compare the two."""
    global _switched_off
    before, _switched_off = _switched_off, True
    try:
        yield
    finally:
        _switched_off = before


def usable(T: int, layout: KVLayout | None, logit_rows) -> bool:
    """Can this step run fused? A decode-only step (one row per sequence) of at most MAX_ROWS rows that needs the
    logits of every row, with a KVLayout, on the `omp` threading layer (the only one that runs the threads of
    a parallel loop at the same time, which a barrier needs)."""
    if layout is None or _switched_off or _disabled_reason is not None or not 1 <= T <= MAX_ROWS \
            or len(layout.context_lens) != T:
        return False
    return regions_can_run(T, logit_rows)


def decode_step(model, tokens: np.ndarray, layout: KVLayout) -> np.ndarray | None:
    """The logits [T, V] of a decode step run as one kernel, its K/V written into the layout's cache; None if the
    threads failed to meet (then the step should run the ordinary way: rerunning it rewrites the same slots)."""
    global _disabled_reason
    fw = model.fast
    cfg = model.config
    T = len(tokens)
    positions = layout.context_lens - 1                                            # [T]
    x = model.embed[tokens]                                                        # [T, D] (a copy: ours)
    logits = np.empty((T, fw.lm_head.w.shape[0] * BLOCK), np.float32)             # [T, V]
    sync = np.zeros(SYNC_SIZE, np.int64)
    n_threads = threads()
    rows = StepRows(x, model.rope_cos[positions], model.rope_sin[positions], np.float32(cfg.norm_eps), cfg.n_heads,
                    is_w8a8(fw.mode))
    kv = KVView(layout.k, layout.v, layout.block_tables, layout.block_size, layout.context_lens)
    try:
        _run_kernel(fw, StepThreads(n_threads, sync, TIMEOUT_CYCLES), rows, kv, logits)
    except Exception as e:                 # it failed to compile for this CPU (the step itself raises nothing)
        if _decode_step_kernel.signatures:
            raise
        _disabled_reason = f"the fused decode step did not compile here ({type(e).__name__}: {str(e)[:200]})"
        warnings.warn(f"tinyserve: {_disabled_reason}; decode steps take the three-call path", RuntimeWarning,
                      stacklevel=2)
        return None
    if sync[FAILED]:
        _disabled_reason = (f"the {n_threads} threads of a fused decode step did not meet within "
                            f"{TIMEOUT_CYCLES:.0e} cycles")
        warnings.warn(f"tinyserve: {_disabled_reason}; decode steps take the three-call path from now on",
                      RuntimeWarning, stacklevel=2)
        return None
    return logits
