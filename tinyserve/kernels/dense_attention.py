"""Causal attention over a contiguous KV cache in Numba: gqa.grouped_attention's arrays in and out.

The kv_cache strategy (lessons 2-3) on the numba backend uses it. At prefill it is the part of the step that is
not a weight matmul: 512 new rows over 512 keys is ~9 GFLOP for SmolLM2's 30 layers, which NumPy does with
single-threaded BLAS (the numba backend keeps BLAS at one thread, see kernels/__init__.py) plus a softmax over the
full S x S square, half of which the causal mask throws away.

What it does differently from the NumPy reference:
- work items are (query head, block of ROWS query rows), run in parallel; a block computes scores only for the
  keys its last row can see (the causal mask skips the rest instead of computing and discarding it);
- Q K^T and P V run on the register-tiled FMA microkernel (kernels/simd.py), K transposed once per call so a
  tile's 64 keys are contiguous (a 4-row P V tile gives a row that does not see a key the weight 0: fma(0, v, x)
  is x, the rule's sum unchanged);
- float sums in another order than BLAS and a vectorisable exp (kernels/fast_exp.py, within 2e-7 relative of
  the true exp): results match the reference within rtol 1e-4 (as the paged kernel; tests/test_kernels.py).
Below FEW_ROWS new rows (decode) a second, serial kernel runs each row as the paged kernel's decode row does.

The order of every sum is kernels/key_chunks.py's rule, the paged kernels' too: keys in chunks of 64 positions in
ascending order, one online-softmax update per chunk, each score one fma chain over d (the microkernel's order),
each chunk's P V one fma chain over its keys (the microkernel again, into a scratch) joined to the running sum as
acc * alpha + pv. A prompt's row therefore gets the bits a decode row at its position gets, in either kernel here
or in the paged ones, so `generate` (this contiguous cache) and the Engine (paged) give the same logits.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .attention import decode_attention_heads, decode_scratch, paged_attention_numba_unchecked
from .key_chunks import CHUNK, chunk_softmax, combine, finish
from .simd import make_fma_microkernel

ROWS = 16                        # query rows per work item


_qk_4x4 = make_fma_microkernel(4, 4, b_int8=False)   # 4 rows x 64 keys
_qk_1x4 = make_fma_microkernel(1, 4, b_int8=False)
_pv_4x4 = make_fma_microkernel(4, 4, b_int8=False)   # 4 rows x 64 of the head dim
_pv_4x1 = make_fma_microkernel(4, 1, b_int8=False)   # 4 rows x 16 of the head dim
_pv_1x1 = make_fma_microkernel(1, 1, b_int8=False)


@njit(cache=True, parallel=True)
def _attention(q, k, v, out):
    m, N, H = q.shape
    S, K, _ = k.shape
    g = N // K
    S_pad = (S + CHUNK - 1) // CHUNK * CHUNK
    kt = np.zeros((K, H, S_pad), np.float32)                  # [K, H, S_pad]: keys contiguous per (head, dim)
    for kd in prange(K * H):
        for j in range(S):
            kt[kd // H, kd % H, j] = k[j, kd // H, kd % H]
    qf, ktf, vf = q.ravel(), kt.ravel(), v.ravel()
    scale = np.float32(1.0 / math.sqrt(H))
    n_blocks = (m + ROWS - 1) // ROWS
    for item in prange(N * n_blocks):
        h, rb = item // n_blocks, item % n_blocks
        kh = h // g
        r0 = rb * ROWS
        nr = min(ROWS, m - r0)
        visible = S - m + r0 + nr                              # keys the block's last row sees
        width = (visible + CHUNK - 1) // CHUNK * CHUNK
        p = np.zeros((ROWS, width), np.float32)                # scores, then exp weights
        pf = p.ravel()
        r = 0
        while r < nr:                                          # Q K^T, 4 rows x 64 keys per microkernel call: each
            for kb in range(width // 64):                      # score one fma chain over d from 0 (the rule's)
                if nr - r >= 4:
                    _qk_4x4(qf, ((r0 + r) * N + h) * H, N * H, ktf, kh * H * S_pad + kb * 64, 16, H, S_pad,
                            pf, r * width + kb * 64, width)
                else:
                    _qk_1x4(qf, ((r0 + r) * N + h) * H, N * H, ktf, kh * H * S_pad + kb * 64, 16, H, S_pad,
                            pf, r * width + kb * 64, width)
            r += 4 if nr - r >= 4 else 1
        pv = np.empty((ROWS, H), np.float32)                   # a chunk's weights * V, per row
        pvf = pv.ravel()
        acc = np.zeros((ROWS, H), np.float32)                  # the rule's m, l, acc per row
        mx = np.full(ROWS, -np.inf, np.float32)
        sm = np.zeros(ROWS, np.float32)
        alpha = np.empty(ROWS, np.float32)
        for c0 in range(0, visible, CHUNK):                    # the key chunks, in ascending order
            for rr in range(nr):                               # the softmax step of every row that sees the chunk;
                nt = min(CHUNK, S - m + r0 + rr + 1 - c0)      # weights of keys it does not see are 0 (the 4-row
                if nt > 0:                                     # P V tile below adds them: fma(0, v, x) = x)
                    mx[rr], alpha[rr], sm[rr] = chunk_softmax(p[rr, c0:c0 + CHUNK], nt, scale, mx[rr], sm[rr])
                for j in range(max(nt, 0), CHUNK):
                    p[rr, c0 + j] = 0.0
            r = 0
            while r < nr:                                      # P V over the chunk, 4 rows x 16 dims per call
                four = nr - r >= 4
                n_keys = min(CHUNK, S - m + r0 + r + (4 if four else 1) - c0)   # the group's last row's keys
                if n_keys > 0:
                    if H % 64 == 0 and four:                   # 16 accumulators: enough chains to fill the FMA pipes
                        for c in range(H // 64):
                            _pv_4x4(pf, r * width + c0, width, vf, c0 * K * H + kh * H + c * 64, 16, n_keys, K * H,
                                    pvf, r * H + c * 64, H)
                    else:
                        for c in range(H // 16):
                            if four:
                                _pv_4x1(pf, r * width + c0, width, vf, c0 * K * H + kh * H + c * 16, 16, n_keys,
                                        K * H, pvf, r * H + c * 16, H)
                            else:
                                _pv_1x1(pf, r * width + c0, width, vf, c0 * K * H + kh * H + c * 16, 16, n_keys,
                                        K * H, pvf, r * H + c * 16, H)
                r += 4 if four else 1
            for rr in range(nr):
                if S - m + r0 + rr + 1 - c0 > 0:
                    combine(acc[rr], alpha[rr], pv[rr])
        for rr in range(nr):
            finish(acc[rr], sm[rr], out[r0 + rr, h])


@njit(cache=True)
def _few_rows_attention(q, k, v, out):
    """The same for a few new rows (decode: m = 1), on one thread: one row is N H S multiply-adds twice per layer,
    less than waking the thread pool costs, and far less than NumPy's ten calls per layer spend on dispatch. Each
    row is a decode row of the paged kernel (attention.decode_attention_heads) over a cache of one block: the
    contiguous K/V."""
    m, N, _ = q.shape
    S, K, _ = k.shape
    block_tables = np.zeros((m, 1), np.int64)
    context_lens = np.arange(S - m + 1, S + 1)                # row r sees S - m + r + 1 keys
    fs, ints = decode_scratch(N // K, q.shape[2])
    for r in range(m):
        for kh in range(K):
            decode_attention_heads(q, k, v, block_tables, S, context_lens, r, kh, 0, N // K, out, fs, ints)


FEW_ROWS = 16    # below this many new rows: _few_rows_attention (serial), from it on: _attention (parallel, tiled)


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """q [m, N, H], k, v [S, K, H] (the last m keys are the new rows) -> [m, N, H]; H must be a multiple of 16."""
    if q.shape[2] % 16:
        raise ValueError(f"the numba attention kernel needs head_dim % 16 == 0, got {q.shape[2]}")
    out = np.empty(q.shape, np.float32)
    kernel = _attention if q.shape[0] >= FEW_ROWS else _few_rows_attention
    kernel(np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v), out)
    return out


def window_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, window: int) -> np.ndarray:
    """A sliding-window layer's attention over a contiguous cache (Gemma 3's local layers on the numba backend):
    q [m, N, H], k, v [S, K, H] (the last m keys are the new rows) -> [m, N, H], row i seeing only its last `window`
    keys. The cache is one block of S positions for the paged kernels, so a row adds its terms in key_chunks' order
    with a window: the bits of the same row in the paged engine. While the cache holds no more than `window`
    positions the window hides nothing (the paged kernels then take the same steps as for a global layer), so the
    row-tiled causal kernel runs instead: the same bits, at a prefill's speed."""
    S, m = k.shape[0], q.shape[0]
    if S <= window:
        return causal_attention(q, k, v)
    return paged_attention_numba_unchecked(q, np.ascontiguousarray(k, np.float32)[None],
                                           np.ascontiguousarray(v, np.float32)[None], np.zeros((1, 1), np.int64),
                                           np.array([S], np.int64), np.array([0, m], np.int64), window)
