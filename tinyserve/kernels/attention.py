"""Paged attention as a Numba kernel: the same arrays in and out as tinyserve.paged.paged_attention.

What it does differently from the NumPy reference (one line): instead of gathering each sequence's whole K/V
into a contiguous copy and calling BLAS, it walks the block table tile by tile with an online softmax, in
parallel over (sequence, chunk of rows, partition of the context). Float32 throughout; the sums run in a
different order than BLAS, so results match the reference within rtol 1e-4 / atol 1e-5 (tests/test_kernels.py;
observed differences ~1e-6).

How the work is cut (the `prange` loop runs over work items):
- a work item is (sequence b, up to ROWS of its query rows, one PARTITION of its positions). Partitions let a
  single long sequence keep both cores busy (one decoding row at 4k context = 16 items), the way
  flash-decoding splits the KV axis on a GPU; row chunks let a long prefill chunk spread over cores too.
- inside an item we walk the partition TILE positions at a time. The tile's K rows are copied, transposed,
  into a small scratch kt[K, H, TILE] that stays in cache. Why transpose: a score is a dot product over H,
  and without fastmath LLVM may not reorder a running sum, so `s += q[d] * k[d]` runs one float at a time.
  With keys contiguous, the loop becomes s[j] += q[d] * kt[d, j] over j: elementwise, so it uses SIMD with
  every sum still added in order. The copy is paid once per tile and shared by every row and head of the item.
- GQA: query head h reads K/V head h // g; each K tile serves all N heads, each V row its g query heads.
- online softmax per tile: keep a running max, sum of exp and weighted sum of V per (row, head); when a
  tile raises the max, rescale what we have by exp(old_max - new_max). Each item writes that partial result;
  a short serial loop then merges the partitions of each row:
      out = sum_p exp(max_p - M) * acc_p / sum_p exp(max_p - M) * sum_p,   M = max_p max_p
Speed vs the NumPy paths: tools/bench_attention.py.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ..attention_backends import check_paged_inputs
from . import check_threading_layer
from .fast_exp import exp_row, row_max

PARTITION = 256   # positions per work item: a 1k-context decode row gives 4 items, enough for 2 cores
TILE = 64         # positions per step inside an item: kt is K*H*TILE*4 = 48 KiB for SmolLM2, cache-resident
ROWS = 16         # query rows per work item: they share each transposed K tile


@njit(cache=True)
def _work_items(context_lens, query_starts, partition, rows_per_item):
    """The items (seq, first row, end row, partition) and, per row t, where its partial results go.

    Row i of the m new rows of a sequence with ctx positions sees positions 0 .. ctx - m + i (the rectangular
    causal mask), so it has ceil((ctx - m + i + 1) / partition) partitions; their partials are stored at
    row_first[t] + p for p = 0, 1, ...
    """
    B = context_lens.shape[0]
    T = query_starts[B]
    row_first = np.empty(T + 1, np.int64)                                     # [T+1]
    n_partials = 0
    for b in range(B):
        m = query_starts[b + 1] - query_starts[b]
        for i in range(m):
            row_first[query_starts[b] + i] = n_partials
            n_partials += (context_lens[b] - m + i + 1 + partition - 1) // partition
    row_first[T] = n_partials
    n_items = 0                                                               # count, then fill
    for b in range(B):
        m = query_starts[b + 1] - query_starts[b]
        for r0 in range(0, m, rows_per_item):
            last_visible = context_lens[b] - m + min(r0 + rows_per_item, m)   # of the chunk's last row
            n_items += (last_visible + partition - 1) // partition
    items = np.empty((n_items, 4), np.int64)                                  # [items, (seq, t0, t1, p)]
    it = 0
    for b in range(B):
        m = query_starts[b + 1] - query_starts[b]
        for r0 in range(0, m, rows_per_item):
            r1 = min(r0 + rows_per_item, m)
            for p in range((context_lens[b] - m + r1 + partition - 1) // partition):
                items[it, 0] = b
                items[it, 1] = query_starts[b] + r0
                items[it, 2] = query_starts[b] + r1
                items[it, 3] = p
                it += 1
    return items, row_first


@njit(cache=True, parallel=True)
def _paged_attention_kernel(q, k_cache, v_cache, block_tables, context_lens, query_starts, partition, out):
    # q, out: [T, N, H]; k_cache, v_cache: [num_blocks, bs, K, H]; block_tables: [B, max_blocks]
    T, N, H = q.shape
    num_blocks, bs, K = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
    g = N // K
    scale = np.float32(1.0 / math.sqrt(H))
    k_rows = k_cache.reshape(num_blocks * bs, K, H)               # the pool as rows addressed by slot
    v_rows = v_cache.reshape(num_blocks * bs, K, H)
    items, row_first = _work_items(context_lens, query_starts, partition, ROWS)
    n_partials = row_first[T]
    part_max = np.empty((n_partials, N), np.float32)             # running max of the scores
    part_sum = np.empty((n_partials, N), np.float32)             # sum of exp(score - max)
    part_acc = np.empty((n_partials, N, H), np.float32)          # sum of exp(score - max) * v

    for it in prange(items.shape[0]):
        b, t0, t1, p = items[it, 0], items[it, 1], items[it, 2], items[it, 3]
        m = query_starts[b + 1] - query_starts[b]
        first_new = context_lens[b] - m - query_starts[b]         # row t sees positions < first_new + t + 1
        lo = p * partition
        hi = min(lo + partition, first_new + t1)                  # what the item's last row can see
        kt = np.empty((K, H, TILE), np.float32)                   # K tile, transposed: keys contiguous
        slots = np.empty(TILE, np.int64)                          # pool row of each position of the tile
        s = np.empty((N, TILE), np.float32)                       # one row's scores, then probabilities
        mx = np.full((t1 - t0, N), -np.inf, np.float32)
        sm = np.zeros((t1 - t0, N), np.float32)
        acc = np.zeros((t1 - t0, N, H), np.float32)
        for tile_lo in range(lo, hi, TILE):
            n = min(TILE, hi - tile_lo)
            for j in range(n):                                    # the block table walk
                pos = tile_lo + j
                slots[j] = block_tables[b, pos // bs] * bs + pos % bs
            for kh in range(K):
                for d in range(H):
                    for j in range(n):
                        kt[kh, d, j] = k_rows[slots[j], kh, d]
            for t in range(t0, t1):
                i = t - t0
                nt = min(n, first_new + t + 1 - tile_lo)          # causal: row t's visible keys in this tile
                if nt <= 0:
                    continue
                # 1. scores of every head against the tile's keys
                for h in range(N):
                    kh = h // g
                    for j in range(nt):
                        s[h, j] = 0.0
                    for d in range(H):
                        qd = q[t, h, d]
                        for j in range(nt):                       # elementwise over keys: SIMD, order kept
                            s[h, j] += qd * kt[kh, d, j]
                # 2. online softmax: rescale the running sums once per tile, not once per key
                for h in range(N):
                    new_max = max(mx[i, h], scale * row_max(s[h], nt))
                    correction = np.float32(math.exp(mx[i, h] - new_max))   # exp(-inf) = 0 on the first tile
                    for d in range(H):
                        acc[i, h, d] *= correction
                    sm[i, h] = sm[i, h] * correction + exp_row(s[h], nt, scale, new_max)
                    mx[i, h] = new_max
                # 3. weighted sum of V, read in place from the pool; each V row serves its g query heads
                for j in range(nt):
                    for kh in range(K):
                        vrow = v_rows[slots[j], kh]               # [H]
                        for r in range(g):
                            h = kh * g + r
                            w = s[h, j]
                            for d in range(H):
                                acc[i, h, d] += w * vrow[d]
        for t in range(t0, t1):
            if first_new + t + 1 > lo:                            # row t sees this partition
                dst = row_first[t] + p
                part_max[dst] = mx[t - t0]
                part_sum[dst] = sm[t - t0]
                part_acc[dst] = acc[t - t0]

    # merge the partitions of each row (a row with one partition: out = acc / sum). A plain serial loop: it is
    # ~N*H multiply-adds per partial, tiny next to the items, and a second parallel region would cost a
    # second hand-off to the worker threads (on a busy machine, a wait for their next time slice).
    for t in range(T):
        first, end = row_first[t], row_first[t + 1]
        for h in range(N):
            m_all = part_max[first, h]
            for part in range(first + 1, end):
                m_all = max(m_all, part_max[part, h])
            total = np.float32(0.0)
            for d in range(H):
                out[t, h, d] = 0.0
            for part in range(first, end):
                w = np.float32(math.exp(part_max[part, h] - m_all))
                total += w * part_sum[part, h]
                for d in range(H):
                    out[t, h, d] += w * part_acc[part, h, d]
            inv = np.float32(1.0) / total
            for d in range(H):
                out[t, h, d] *= inv


def paged_attention_numba(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                          context_lens: np.ndarray, query_starts: np.ndarray, partition: int = PARTITION) -> np.ndarray:
    """Same contract as tinyserve.paged.paged_attention: q [T, N, H], k_cache/v_cache [num_blocks, bs, K, H],
    block_tables [B, max_blocks] (-1 padded), context_lens [B], query_starts [B+1] -> [T, N, H] float32.
    `partition`: positions per work item (any value >= 1; it need not be a multiple of the block size)."""
    if partition < 1:
        raise ValueError(f"partition must be >= 1, got {partition}")
    block_tables = np.asarray(block_tables)
    check_paged_inputs(q, k_cache, v_cache, block_tables, context_lens, query_starts)
    # one dtype/layout per argument, so numba compiles (and caches) a single specialisation
    out = paged_attention_numba_unchecked(np.ascontiguousarray(q, dtype=np.float32),
                                          np.ascontiguousarray(k_cache, dtype=np.float32),
                                          np.ascontiguousarray(v_cache, dtype=np.float32),
                                          np.ascontiguousarray(block_tables, dtype=np.int64),
                                          np.ascontiguousarray(context_lens, dtype=np.int64),
                                          np.ascontiguousarray(query_starts, dtype=np.int64), int(partition))
    check_threading_layer()
    return out


# A decode step (every sequence runs one new row) needs none of the machinery above: no row chunks, no causal mask
# inside the step, and a context of tens to hundreds of positions. There the general kernel's per-item set-up (the
# transposed tile, six scratch arrays, the partition merge) was most of its time: ~100 us per layer at batch 1 and
# a context of 100 (30 layers: ~3 ms of a ~10 ms step). This kernel reads K and V rows in place from the pool, one
# work item per (sequence, KV head), so each K row is read once for the g query heads that share it.

@njit(cache=True, fastmath={"reassoc", "contract"})
def decode_attention_heads(q, k_rows, v_rows, block_tables, bs, context_lens, b, kh, r_lo, r_hi, out):
    """Sequence b's one new row, query heads r_lo .. r_hi of the g that share KV head kh: out[b, heads] =
    softmax(q K^T / sqrt(H)) V over its context_lens[b] positions. q, out: [B, N, H]; k_rows, v_rows: the pool as
    rows addressed by slot [num_blocks * bs, K, H], position j of sequence b at slot block_tables[b, j // bs] * bs +
    j % bs. Each head's arithmetic is the same whichever others it is computed with (the fused decode step splits a
    KV head's g query heads between threads: kernels/decode_step.py)."""
    N, H = q.shape[1], q.shape[2]
    K = k_rows.shape[1]
    g = N // K
    n = r_hi - r_lo
    scale = np.float32(1.0 / math.sqrt(H))
    S = context_lens[b]
    p = np.empty((n, S), np.float32)                          # scores, then exp(score - max)
    acc = np.zeros((n, H), np.float32)
    for j0 in range(0, S, bs):                                # 1. scores: dot products ("reassoc": 16 lanes)
        first = block_tables[b, j0 // bs] * bs                # (block by block, not j // bs per position: ~15 %
        for j in range(j0, min(S, j0 + bs)):                  # faster at 64 positions: docs/performance.md)
            slot = first + j - j0
            for r in range(n):
                s = np.float32(0.0)
                for d in range(H):
                    s += q[b, kh * g + r_lo + r, d] * k_rows[slot, kh, d]
                p[r, j] = s
    inv = np.empty(n, np.float32)
    for r in range(n):                                        # 2. softmax, vectorised (fast_exp)
        inv[r] = np.float32(1.0) / exp_row(p[r], S, scale, scale * row_max(p[r], S))
    for j0 in range(0, S, bs):                                # 3. P V: each V row serves the n heads
        first = block_tables[b, j0 // bs] * bs
        for j in range(j0, min(S, j0 + bs)):
            slot = first + j - j0
            for r in range(n):
                w = p[r, j]
                for d in range(H):
                    acc[r, d] += w * v_rows[slot, kh, d]
    for r in range(n):
        for d in range(H):
            out[b, kh * g + r_lo + r, d] = acc[r, d] * inv[r]


@njit(cache=True)
def decode_attention_item(q, k_rows, v_rows, block_tables, bs, context_lens, b, kh, out):
    """decode_attention_heads for all g query heads of KV head kh: one work item of _paged_decode_kernel (each K and
    V row read once for the g heads that share it)."""
    decode_attention_heads(q, k_rows, v_rows, block_tables, bs, context_lens, b, kh, 0, q.shape[1] // k_rows.shape[1],
                           out)


@njit(cache=True, parallel=True)
def _paged_decode_kernel(q, k_cache, v_cache, block_tables, context_lens, out):
    # q, out: [B, N, H] (row b is sequence b's one new row); the rest as in _paged_attention_kernel
    B = q.shape[0]
    num_blocks, bs, K, H = k_cache.shape
    k_rows = k_cache.reshape(num_blocks * bs, K, H)
    v_rows = v_cache.reshape(num_blocks * bs, K, H)
    for item in prange(B * K):
        decode_attention_item(q, k_rows, v_rows, block_tables, bs, context_lens, item // K, item % K, out)


def paged_attention_numba_unchecked(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                                    block_tables: np.ndarray, context_lens: np.ndarray, query_starts: np.ndarray,
                                    partition: int = PARTITION) -> np.ndarray:
    """The kernel call alone, for a batch checked once per step (the engine): no checks, no conversions.
    The caller guarantees C-contiguous float32 caches and int64 block_tables / context_lens / query_starts
    (anything else would compile a second specialisation). Only q, the one per-layer array, is made
    contiguous here."""
    q = np.ascontiguousarray(q, dtype=np.float32)
    out = np.empty_like(q)                                                     # [T, N, H]
    if q.shape[0] == context_lens.shape[0]:          # T == B: one row each (every sequence has >= 1), a decode step
        _paged_decode_kernel(q, k_cache, v_cache, block_tables, context_lens, out)
    else:
        _paged_attention_kernel(q, k_cache, v_cache, block_tables, context_lens, query_starts, partition, out)
    return out
