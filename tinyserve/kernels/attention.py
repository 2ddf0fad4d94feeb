"""Paged attention as a Numba kernel: the same arrays in and out as tinyserve.paged.paged_attention.

What it does differently from the NumPy reference (one line): instead of gathering each sequence's whole K/V
into a contiguous copy and calling BLAS, it walks the block table chunk by chunk with an online softmax, in
parallel over (sequence, chunk of rows). Float32 throughout; the sums run in a different order than BLAS, so
results match the reference within rtol 1e-4 / atol 1e-5 (tests/test_kernels.py; observed differences ~1e-6).

The order of the sums is kernels/key_chunks.py's rule, the same in every attention kernel: keys in chunks of 64
positions in ascending order, scores as fused multiply-adds over d, one online-softmax update per chunk. So a row's
output is the same bits whether it is a prefill row here, a decode row of _paged_decode_kernel or of the fused decode
step, or a row of the contiguous-cache kernels (kernels/dense_attention.py), whatever else shares its step.

How the work is cut (the `prange` loop runs over work items):
- a work item is (sequence b, up to ROWS of its query rows): row chunks let a long prefill chunk spread over cores.
  (The context is never split between items, flash-decoding style: merging partial softmaxes would add in another
  order than a decode row does.)
- inside an item we walk the context one rule chunk (TILE = key_chunks.CHUNK positions) at a time. The chunk's K
  rows are copied, transposed, into a small scratch kt[K, H, TILE] that stays in cache. Why transpose: the rule's
  score is a chain of fused multiply-adds over d, and with keys contiguous it runs s[j] = fma(q[d], kt[d, j], s[j])
  over j: elementwise, so 16 keys per SIMD instruction, each chain still in order. The copy is paid once per chunk
  and shared by every row and head of the item.
- GQA: query head h reads K/V head h // g; each K chunk serves all N heads, each V row its g query heads.
Speed vs the NumPy paths: tools/bench_attention.py.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ..attention_backends import check_paged_inputs
from . import check_threading_layer
from .key_chunks import CHUNK, chunk_softmax, chunk_softmax_window, combine, finish, fma32, transpose16
from .simd import make_fma_microkernel, prefetch_l2

TILE = CHUNK      # positions per step inside an item: kt is K*H*TILE*4 bytes, small enough to stay in cache
ROWS = 16         # query rows per work item: they share each transposed K chunk

# A decode row's Q K^T and P V on the register-tiled microkernel (kernels/simd.py): its accumulators stay in
# registers for the whole chain over d (scores) or j (P V). Written as loops over memory, s[j] = fma(q[d], kt[d, j],
# s[j]) stores and reloads every score at every d, and each fma then waits for the store before it.
# The query heads that share a KV head go through one call, up to HEADS at a time: each K (or V) vector loaded
# serves them all, and their independent chains keep both FMA units busy. Each head's chain is still its own, in
# the same order, from 0: the same bits (key_chunks' rule) whichever heads share the call.
HEADS = 4
_scores1, _scores2, _scores3, _scores4 = (make_fma_microkernel(r, CHUNK // 16, b_int8=False) for r in range(1, 5))
_pv1, _pv2, _pv3, _pv4 = (make_fma_microkernel(r, 4, b_int8=False) for r in range(1, 5))   # r heads x 64 dims
_pv1_16, _pv2_16, _pv3_16, _pv4_16 = (make_fma_microkernel(r, 1, b_int8=False) for r in range(1, 5))  # x 16 dims


@njit(cache=True, inline="always")
def _scores(r, q, q_off, kt, s, s_off):
    """s[i, :] = the chunk's 64 scores of the r heads (1 <= r <= HEADS) whose query rows start at q[q_off]."""
    H = kt.shape[0] // CHUNK
    if r == 1:
        _scores1(q, q_off, H, kt, 0, 16, H, CHUNK, s, s_off, CHUNK)
    elif r == 2:
        _scores2(q, q_off, H, kt, 0, 16, H, CHUNK, s, s_off, CHUNK)
    elif r == 3:
        _scores3(q, q_off, H, kt, 0, 16, H, CHUNK, s, s_off, CHUNK)
    else:
        _scores4(q, q_off, H, kt, 0, 16, H, CHUNK, s, s_off, CHUNK)


@njit(cache=True, inline="always")
def _weighted_values(r, s, s_off, vt, nc, pv, pv_off, H):
    """pv[i, :] = sum over the chunk's nc keys of weight * V row, for r heads (1 <= r <= HEADS): one fma chain
    per output over j = 0 .. nc - 1."""
    d0 = 0
    while d0 + 64 <= H:
        if r == 1:
            _pv1(s, s_off, CHUNK, vt, d0, 16, nc, H, pv, pv_off + d0, H)
        elif r == 2:
            _pv2(s, s_off, CHUNK, vt, d0, 16, nc, H, pv, pv_off + d0, H)
        elif r == 3:
            _pv3(s, s_off, CHUNK, vt, d0, 16, nc, H, pv, pv_off + d0, H)
        else:
            _pv4(s, s_off, CHUNK, vt, d0, 16, nc, H, pv, pv_off + d0, H)
        d0 += 64
    while d0 < H:
        if r == 1:
            _pv1_16(s, s_off, CHUNK, vt, d0, 16, nc, H, pv, pv_off + d0, H)
        elif r == 2:
            _pv2_16(s, s_off, CHUNK, vt, d0, 16, nc, H, pv, pv_off + d0, H)
        elif r == 3:
            _pv3_16(s, s_off, CHUNK, vt, d0, 16, nc, H, pv, pv_off + d0, H)
        else:
            _pv4_16(s, s_off, CHUNK, vt, d0, 16, nc, H, pv, pv_off + d0, H)
        d0 += 16


@njit(cache=True, inline="always")
def chunk_slots(block_tables, b, bs, c0, nc, slots):
    """slots[j] = the pool row of sequence b's position c0 + j, j < nc: block_tables[b, pos // bs] * bs + pos % bs,
    walked block by block: one division per chunk, where a division per position by the run-time block size would
    cost a visible share of a decode row's attention. Every attention kernel here walks its chunks' slots with it."""
    blk = c0 // bs
    off = c0 - blk * bs
    base = block_tables[b, blk] * bs
    for j in range(nc):
        slots[j] = base + off
        off += 1
        if off == bs:
            off = 0
            blk += 1
            if j + 1 < nc:
                base = block_tables[b, blk] * bs


@njit(cache=True, inline="always")
def window_slots(block_tables, b, bs, c0, nc, lo, slots):
    """chunk_slots for a chunk of a sliding-window row whose keys before position lo are not seen: their slots
    repeat lo's, so no freed block (a -1 table entry: block_manager.release_behind_window) is ever read; the keys
    read there get weight 0 (key_chunks.chunk_softmax_window). Returns how many of the chunk's keys come before lo."""
    skip = min(max(lo - c0, 0), nc - 1)
    chunk_slots(block_tables, b, bs, c0 + skip, nc - skip, slots[skip:])
    for j in range(skip):
        slots[j] = slots[skip]
    return skip


@njit(cache=True)
def _work_items(query_starts, rows_per_item):
    """The items (seq, first row, end row): every sequence's new rows cut into runs of rows_per_item."""
    B = query_starts.shape[0] - 1
    n_items = 0
    for b in range(B):
        n_items += (query_starts[b + 1] - query_starts[b] + rows_per_item - 1) // rows_per_item
    items = np.empty((n_items, 3), np.int64)                                  # [items, (seq, t0, t1)]
    it = 0
    for b in range(B):
        for t0 in range(query_starts[b], query_starts[b + 1], rows_per_item):
            items[it, 0] = b
            items[it, 1] = t0
            items[it, 2] = min(t0 + rows_per_item, query_starts[b + 1])
            it += 1
    return items


@njit(cache=True, parallel=True)
def _paged_attention_kernel(q, k_cache, v_cache, block_tables, context_lens, query_starts, window, out):
    # q, out: [T, N, H]; k_cache, v_cache: [num_blocks, bs, K, H]; block_tables: [B, max_blocks]; window: the
    # layer's sliding window (0: none), row at position p seeing keys max(0, p - window + 1) .. p
    T, N, H = q.shape
    num_blocks, bs, K = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
    g = N // K
    scale = np.float32(1.0 / math.sqrt(H))
    k_rows = k_cache.reshape(num_blocks * bs, K, H)               # the pool as rows addressed by slot
    v_rows = v_cache.reshape(num_blocks * bs, K, H)
    items = _work_items(query_starts, ROWS)
    tiled = H % 16 == 0                                           # the microkernels' 16-lane blocks
    qf = q.reshape(-1)

    for it in prange(items.shape[0]):
        b, t0, t1 = items[it, 0], items[it, 1], items[it, 2]
        m = query_starts[b + 1] - query_starts[b]
        first_new = context_lens[b] - m - query_starts[b]         # row t sees positions < first_new + t + 1
        hi = first_new + t1                                       # what the item's last row can see
        lo = 0 if window == 0 else max(0, first_new + t0 + 1 - window)   # what its first row sees first
        # (zeroed: the microkernels compute a whole chunk's 64 scores, and columns past the chunk's keys are then
        # computed from these, never read)
        kt = np.zeros((K, H, TILE), np.float32)                   # K chunk, transposed: keys contiguous
        vt = np.zeros((K, TILE, H), np.float32)                   # V chunk, gathered (tiled: the microkernels')
        slots = np.empty(TILE, np.int64)                          # pool row of each position of the chunk
        s = np.zeros((N, TILE), np.float32)                       # one row's scores, then exp weights
        pv = np.empty((N, H), np.float32)                         # one row's chunk sum of weights * V
        sf, pvf = s.reshape(-1), pv.reshape(-1)
        mx = np.full((t1 - t0, N), -np.inf, np.float32)           # the rule's m, l, acc per (row, head)
        sm = np.zeros((t1 - t0, N), np.float32)
        acc = np.zeros((t1 - t0, N, H), np.float32)
        alpha = np.empty(N, np.float32)
        for tile_lo in range(lo - lo % TILE, hi, TILE):          # the rule's chunks, from the one holding lo
            n = min(TILE, hi - tile_lo)
            window_slots(block_tables, b, bs, tile_lo, n, lo, slots)  # the block table walk
            for kh in range(K):
                for d in range(H):
                    for j in range(n):
                        kt[kh, d, j] = k_rows[slots[j], kh, d]
                if tiled:
                    for j in range(n):
                        vrow = v_rows[slots[j], kh]
                        for d in range(H):
                            vt[kh, j, d] = vrow[d]
            for t in range(t0, t1):
                i = t - t0
                nt = min(n, first_new + t + 1 - tile_lo)          # causal: row t's visible keys in this chunk
                j0 = 0 if window == 0 else max(0, first_new + t + 1 - window - tile_lo)   # behind row t's window
                if nt <= j0:
                    continue
                # 1. scores of every head against the chunk's keys: on the decode rows' register-tiled microkernels
                # when H allows (each score one fma chain over d from 0, as below: the same bits)
                if tiled:
                    for kh in range(K):
                        for r0 in range(0, g, HEADS):
                            _scores(min(HEADS, g - r0), qf, (t * N + kh * g + r0) * H, kt[kh].reshape(-1), sf,
                                    (kh * g + r0) * CHUNK)
                else:
                    for h in range(N):
                        kh = h // g
                        for j in range(nt):
                            s[h, j] = 0.0
                        for d in range(H):
                            qd = q[t, h, d]
                            for j in range(nt):                   # elementwise over keys: SIMD, chains in order
                                s[h, j] = fma32(qd, kt[kh, d, j], s[h, j])
                # 2. the online-softmax step of the rule
                for h in range(N):
                    if j0 == 0:
                        mx[i, h], alpha[h], sm[i, h] = chunk_softmax(s[h], nt, scale, mx[i, h], sm[i, h])
                    else:
                        mx[i, h], alpha[h], sm[i, h] = chunk_softmax_window(s[h], j0, nt, scale, mx[i, h], sm[i, h])
                # 3. weighted sum of V; each V row serves its g query heads (the weights before j0 are 0: fma adds
                # nothing, so the microkernels' chains over all nt keys give the same bits as from j0)
                if tiled:
                    for kh in range(K):
                        for r0 in range(0, g, HEADS):
                            _weighted_values(min(HEADS, g - r0), sf, (kh * g + r0) * CHUNK, vt[kh].reshape(-1), nt,
                                             pvf, (kh * g + r0) * H, H)
                else:
                    pv[:] = 0.0
                    for j in range(j0, nt):
                        for kh in range(K):
                            vrow = v_rows[slots[j], kh]           # [H], read in place from the pool
                            for r in range(g):
                                h = kh * g + r
                                w = s[h, j]
                                for d in range(H):
                                    pv[h, d] = fma32(w, vrow[d], pv[h, d])
                for h in range(N):
                    combine(acc[i, h], alpha[h], pv[h])
        for t in range(t0, t1):
            for h in range(N):
                finish(acc[t - t0, h], sm[t - t0, h], out[t, h])


def paged_attention_numba(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                          context_lens: np.ndarray, query_starts: np.ndarray, window: int | None = None) -> np.ndarray:
    """Same contract as tinyserve.paged.paged_attention: q [T, N, H], k_cache/v_cache [num_blocks, bs, K, H],
    block_tables [B, max_blocks] (-1 padded; with a `window`, -1 also before the first row's window),
    context_lens [B], query_starts [B+1] -> [T, N, H] float32."""
    block_tables = np.asarray(block_tables)
    check_paged_inputs(q, k_cache, v_cache, block_tables, context_lens, query_starts, window)
    # one dtype/layout per argument, so numba compiles (and caches) a single specialisation
    out = paged_attention_numba_unchecked(np.ascontiguousarray(q, dtype=np.float32),
                                          np.ascontiguousarray(k_cache, dtype=np.float32),
                                          np.ascontiguousarray(v_cache, dtype=np.float32),
                                          np.ascontiguousarray(block_tables, dtype=np.int64),
                                          np.ascontiguousarray(context_lens, dtype=np.int64),
                                          np.ascontiguousarray(query_starts, dtype=np.int64), window)
    if not _one_item(q, k_cache, context_lens):       # (the one-item kernel starts no threads to check)
        check_threading_layer()
    return out


# A decode step (every sequence runs one new row) needs none of the machinery above: no row chunks, no causal mask
# inside the step, and a context of tens to hundreds of positions. There the general kernel's per-item set-up is
# most of its time, a large share of a batch-1 step over all layers. This
# kernel has one work item per (sequence, KV head), so each K chunk is transposed once for the g query heads that
# share it; the arithmetic per (row, head) is the rule's, operation for operation.

@njit(cache=True, inline="always")
def decode_scratch(g, H):
    """The float32 and int64 scratch of decode_attention_heads for up to g heads of dimension H (allocate once,
    reuse for every call on one thread)."""
    return np.zeros(2 * H * CHUNK + g * CHUNK + 2 * g * H + 3 * g, np.float32), np.empty(CHUNK + 16, np.int64)


@njit(cache=True, inline="always")
def _prefetch_position(kf, vf, block_tables, bs, K, H, b, kh, j):
    """Ask into L2 the K and V rows of sequence b's position j, KV head kh (kf, vf: the pool's rows, flat), 16
    floats (a 64-byte line) at a time."""
    base = ((block_tables[b, j // bs] * bs + j % bs) * K + kh) * H
    for d in range(0, H, 16):
        prefetch_l2(kf, base + d)
        prefetch_l2(vf, base + d)


@njit(cache=True)
def decode_attention_heads(q, k_rows, v_rows, block_tables, bs, context_lens, b, kh, r_lo, r_hi, out, fs, ints,
                           nb=-1, nkh=0, window=0):
    """Sequence b's one new row, query heads r_lo .. r_hi of the g that share KV head kh: out[b, heads] =
    softmax(q K^T / sqrt(H)) V over its context_lens[b] positions, in key_chunks' order. q, out: [B, N, H]; k_rows,
    v_rows: the pool as rows addressed by slot [num_blocks * bs, K, H], position j of sequence b at slot
    block_tables[b, j // bs] * bs + j % bs (a contiguous cache: one block of bs >= the context). Each head's
    arithmetic is the same whichever others it is computed with (the fused decode step splits a KV head's g query
    heads between threads: kernels/decode_step.py). fs, ints: decode_scratch(g, H), reused across calls (a call
    per (row, KV head) allocating its own cost ~10 % of the attention). nb, nkh: the (sequence, KV head) this
    thread attends next (nb = -1: none). Its K/V rows are asked into L2 one position per V row gathered here, so they
    arrive while this run computes; asked for all at once before the run, most of the requests stalled it or were
    dropped (docs/performance.md, "where a batch-16 step goes"). window > 0: a sliding-window layer's row, which
    sees only its last `window` positions (key_chunks' rule with a window; no prefetch: the next run's older blocks
    may be freed)."""
    N, H = q.shape[1], q.shape[2]
    K = k_rows.shape[1]
    g = N // K
    n = r_hi - r_lo
    scale = np.float32(1.0 / math.sqrt(H))
    S = context_lens[b]
    tiled = H % 16 == 0                                       # the microkernels' 16-lane blocks
    # fs's parts. kt's columns past a chunk's keys hold a former chunk's keys (or the zeros fs starts with):
    # their scores are computed and never read.
    o = 0
    ktf = fs[o:o + H * CHUNK]                                 # the chunk's keys of head kh, transposed [H, CHUNK]
    o += H * CHUNK
    vtf = fs[o:o + CHUNK * H]                                 # the chunk's values of head kh, gathered [CHUNK, H]
    o += CHUNK * H
    sf = fs[o:o + n * CHUNK]                                  # scores, then exp weights [n, CHUNK]
    o += g * CHUNK
    pvf = fs[o:o + n * H]                                     # [n, H]
    o += g * H
    acc = fs[o:o + n * H].reshape(n, H)
    o += g * H
    mx, sm, alpha = fs[o:o + n], fs[o + g:o + g + n], fs[o + 2 * g:o + 2 * g + n]
    kt, vt, s, pv = ktf.reshape(H, CHUNK), vtf.reshape(CHUNK, H), sf.reshape(n, CHUNK), pvf.reshape(n, H)
    slots, offs = ints[:CHUNK], ints[CHUNK:CHUNK + 16]
    kf, qf, vf = k_rows.reshape(-1), q.reshape(-1), v_rows.reshape(-1)
    mx[:] = -np.inf
    sm[:] = 0.0
    acc[:] = 0.0
    lo = 0 if window == 0 else max(0, S - window)             # the first position the row sees
    if window > 0:
        nb = -1
    for c0 in range(lo - lo % CHUNK, S, CHUNK):
        nc = min(CHUNK, S - c0)
        skip = window_slots(block_tables, b, bs, c0, nc, lo, slots)   # keys before skip: behind the window
        if tiled:                                             # transpose: the scores then run 16 keys a vector
            for j0 in range(0, nc, 16):                       # (16 x 16 blocks in registers; a block's rows past
                for r in range(16):                           # the context repeat its first, never read)
                    offs[r] = (slots[j0 + r if j0 + r < nc else j0] * K + kh) * H
                for d0 in range(0, H, 16):
                    transpose16(kf, offs, ktf, d0 * CHUNK + j0, CHUNK)
                    for r in range(16):
                        offs[r] += 16
            for j in range(nc):                               # (indexed by loop counters: a slice assignment
                vrow = v_rows[slots[j], kh]                       # or a computed flat index compiles to
                for d in range(H):                                # element-wise copies or gathers)
                    vt[j, d] = vrow[d]
                if nb >= 0 and c0 + j < context_lens[nb] - 1:
                    _prefetch_position(kf, vf, block_tables, bs, K, H, nb, nkh, c0 + j)
            for r0 in range(0, n, HEADS):                     # 1. scores, HEADS heads a call
                _scores(min(HEADS, n - r0), qf, (b * N + kh * g + r_lo + r0) * H, ktf, sf, r0 * CHUNK)
        else:
            for j in range(nc):
                for d in range(H):
                    kt[d, j] = k_rows[slots[j], kh, d]
            for r in range(n):
                h = kh * g + r_lo + r
                for j in range(nc):
                    s[r, j] = 0.0
                for d in range(H):
                    qd = q[b, h, d]
                    for j in range(nc):
                        s[r, j] = fma32(qd, kt[d, j], s[r, j])
        for r in range(n):                                    # 2. the softmax step
            if skip == 0:
                mx[r], alpha[r], sm[r] = chunk_softmax(s[r], nc, scale, mx[r], sm[r])
            else:
                mx[r], alpha[r], sm[r] = chunk_softmax_window(s[r], skip, nc, scale, mx[r], sm[r])
        if tiled:                                             # 3. P V: pv[r, d] = one fma chain over the nc keys
            for r0 in range(0, n, HEADS):
                _weighted_values(min(HEADS, n - r0), sf, r0 * CHUNK, vtf, nc, pvf, r0 * H, H)
        else:
            pv[:] = 0.0                                       # each V row serves the n heads
            for j in range(nc):
                vrow = v_rows[slots[j], kh]
                for r in range(n):
                    w = s[r, j]
                    for d in range(H):
                        pv[r, d] = fma32(w, vrow[d], pv[r, d])
        for r in range(n):
            combine(acc[r], alpha[r], pv[r])
    if nb >= 0:                                               # the next run's positions past this one's
        for j in range(S, context_lens[nb] - 1):
            _prefetch_position(kf, vf, block_tables, bs, K, H, nb, nkh, j)
    for r in range(n):
        finish(acc[r], sm[r], out[b, kh * g + r_lo + r])


@njit(cache=True)
def decode_attention_item(q, k_rows, v_rows, block_tables, bs, context_lens, b, kh, out, window=0):
    """decode_attention_heads for all g query heads of KV head kh: one work item of _paged_decode_kernel (each K and
    V row read once for the g heads that share it)."""
    g, H = q.shape[1] // k_rows.shape[1], q.shape[2]
    fs, ints = decode_scratch(g, H)
    decode_attention_heads(q, k_rows, v_rows, block_tables, bs, context_lens, b, kh, 0, g, out, fs, ints, -1, 0,
                           window)


def _paged_decode(q, k_cache, v_cache, block_tables, context_lens, window, out):
    # q, out: [B, N, H] (row b is sequence b's one new row); the rest as in _paged_attention_kernel
    B = q.shape[0]
    num_blocks, bs, K, H = k_cache.shape
    k_rows = k_cache.reshape(num_blocks * bs, K, H)
    v_rows = v_cache.reshape(num_blocks * bs, K, H)
    for item in prange(B * K):
        decode_attention_item(q, k_rows, v_rows, block_tables, bs, context_lens, item // K, item % K, out, window)


# One work item (B = 1 with one K/V head: Gemma 3 at batch 1) has nothing to share, and forking the thread pool for
# it still costs a join, a time slice when a neighbour holds the other core: that one runs on the calling thread.
# Same item function, same bits.
_paged_decode_kernel = njit(cache=True, parallel=True)(_paged_decode)
_paged_decode_one_item = njit(cache=True)(_paged_decode)


def _one_item(q, k_cache, context_lens) -> bool:
    """A decode step (T == B) of one sequence with one K/V head: _paged_decode_one_item's case."""
    return q.shape[0] == len(context_lens) and q.shape[0] * k_cache.shape[2] == 1


def paged_attention_numba_unchecked(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                                    block_tables: np.ndarray, context_lens: np.ndarray, query_starts: np.ndarray,
                                    window: int | None = None) -> np.ndarray:
    """The kernel call alone, for a batch checked once per step (the engine): no checks, no conversions.
    The caller guarantees C-contiguous float32 caches and int64 block_tables / context_lens / query_starts
    (anything else would compile a second specialisation). Only q, the one per-layer array, is made
    contiguous here. window: a sliding-window layer's (None: a global layer)."""
    q = np.ascontiguousarray(q, dtype=np.float32)
    out = np.empty_like(q)                                                     # [T, N, H]
    w = 0 if window is None else int(window)                                   # one int64 specialisation
    if q.shape[0] == context_lens.shape[0]:          # T == B: one row each (every sequence has >= 1), a decode step
        kernel = _paged_decode_one_item if _one_item(q, k_cache, context_lens) else _paged_decode_kernel
        kernel(q, k_cache, v_cache, block_tables, context_lens, w, out)
    else:
        _paged_attention_kernel(q, k_cache, v_cache, block_tables, context_lens, query_starts, w, out)
    return out
