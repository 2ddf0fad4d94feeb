"""Causal attention over a contiguous KV cache in Numba: gqa.grouped_attention's arrays in and out.

The kv_cache strategy (lessons 2-3) on the numba backend uses it. At prefill it is the part of the step that is
not a weight matmul: 512 new rows over 512 keys is ~9 GFLOP for SmolLM2's 30 layers, which NumPy does with
single-threaded BLAS (the numba backend keeps BLAS at one thread, see kernels/__init__.py) plus a softmax over the
full S x S square, half of which the causal mask throws away.

What it does differently from the NumPy reference:
- work items are (query head, block of ROWS query rows), run in parallel; a block computes scores only for the
  keys its last row can see (the causal mask skips the rest instead of computing and discarding it);
- Q K^T and P V run on the register-tiled FMA microkernel (kernels/simd.py), K transposed once per call so a
  tile's 64 keys are contiguous;
- float sums in another order than BLAS and a vectorisable exp (kernels/fast_exp.py, within 2e-7 relative of
  the true exp): results match the reference within rtol 1e-4 (as the paged kernel; tests/test_kernels.py).
Below FEW_ROWS new rows (decode) a second, serial kernel does the same with plain loops: one row is too little
work to wake the thread pool for.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .fast_exp import exp_row, row_max
from .simd import make_fma_microkernel

ROWS = 16                        # query rows per work item


@njit(cache=True)
def _softmax_row(x, see, width, scale):
    """x[:see] <- exp(scale * (x[:see] - max)), x[see:width] <- 0 (masked keys and padding); returns 1 / their sum
    (the caller scales the row of P V by it: 64 multiplies instead of `see`).

    Two passes LLVM vectorises 16 keys wide: the max (fast_exp.row_max: an integer max over the floats' ordered
    bits; a float max reduction stays scalar, ~5x slower here), and exp + sum in one loop (fast_exp.exp_row).
    """
    total = exp_row(x, see, scale, scale * row_max(x, see))
    for j in range(see, width):
        x[j] = 0.0
    return np.float32(1.0) / total


_qk_4x4 = make_fma_microkernel(4, 4, b_int8=False)   # 4 rows x 64 keys
_qk_1x4 = make_fma_microkernel(1, 4, b_int8=False)
_pv_4x4 = make_fma_microkernel(4, 4, b_int8=False)   # 4 rows x 64 of the head dim (H = 64, SmolLM2)
_pv_4x1 = make_fma_microkernel(4, 1, b_int8=False)   # 4 rows x 16 of the head dim
_pv_1x1 = make_fma_microkernel(1, 1, b_int8=False)


@njit(cache=True, parallel=True)
def _attention(q, k, v, out):
    m, N, H = q.shape
    S, K, _ = k.shape
    g = N // K
    S_pad = (S + 63) // 64 * 64
    kt = np.zeros((K, H, S_pad), np.float32)                  # [K, H, S_pad]: keys contiguous per (head, dim)
    for kd in prange(K * H):
        for j in range(S):
            kt[kd // H, kd % H, j] = k[j, kd // H, kd % H]
    qf, ktf, vf, of = q.ravel(), kt.ravel(), v.ravel(), out.ravel()
    scale = np.float32(1.0 / math.sqrt(H))
    n_blocks = (m + ROWS - 1) // ROWS
    for item in prange(N * n_blocks):
        h, rb = item // n_blocks, item % n_blocks
        kh = h // g
        r0 = rb * ROWS
        nr = min(ROWS, m - r0)
        visible = S - m + r0 + nr                              # keys the block's last row sees
        width = (visible + 63) // 64 * 64
        p = np.zeros((ROWS, width), np.float32)                # scores, then probabilities
        pf = p.ravel()
        r = 0
        while r < nr:                                          # Q K^T, 4 rows x 64 keys per microkernel call
            for kb in range(width // 64):
                if nr - r >= 4:
                    _qk_4x4(qf, ((r0 + r) * N + h) * H, N * H, ktf, kh * H * S_pad + kb * 64, 16, H, S_pad,
                            pf, r * width + kb * 64, width)
                else:
                    _qk_1x4(qf, ((r0 + r) * N + h) * H, N * H, ktf, kh * H * S_pad + kb * 64, 16, H, S_pad,
                            pf, r * width + kb * 64, width)
            r += 4 if nr - r >= 4 else 1
        inv = np.empty(ROWS, np.float32)
        for rr in range(nr):                                   # softmax over the keys row rr may see
            inv[rr] = _softmax_row(p[rr], S - m + r0 + rr + 1, width, scale)
        r = 0
        while r < nr:                                          # P V, 4 rows x 16 dims per call
            if H == 64 and nr - r >= 4:
                _pv_4x4(pf, r * width, width, vf, kh * H, 16, visible, K * H, of, ((r0 + r) * N + h) * H, N * H)
                r += 4
                continue
            for c in range(H // 16):
                if nr - r >= 4:
                    _pv_4x1(pf, r * width, width, vf, kh * H + c * 16, 16, visible, K * H,
                            of, ((r0 + r) * N + h) * H + c * 16, N * H)
                else:
                    _pv_1x1(pf, r * width, width, vf, kh * H + c * 16, 16, visible, K * H,
                            of, ((r0 + r) * N + h) * H + c * 16, N * H)
            r += 4 if nr - r >= 4 else 1
        for rr in range(nr):                                   # normalise: (P V) / sum(P)
            for d in range(H):
                out[r0 + rr, h, d] *= inv[rr]


@njit(cache=True, fastmath={"reassoc", "contract"})
def _few_rows_attention(q, k, v, out):
    """The same for a few new rows (decode: m = 1), on one thread: one row is ~0.1 M multiply-adds per layer at a
    context of 100, less than waking the thread pool costs, and ~30x less than NumPy's ten calls per layer spend on
    dispatch. A row's scores are plain dot products ("reassoc": 16 lanes wide), then _softmax_row and P V."""
    m, N, H = q.shape
    S, K, _ = k.shape
    g = N // K
    scale = np.float32(1.0 / math.sqrt(H))
    p = np.empty(S, np.float32)
    acc = np.empty(H, np.float32)
    for r in range(m):
        see = S - m + r + 1
        for h in range(N):
            kh = h // g
            for j in range(see):
                s = np.float32(0.0)
                for d in range(H):
                    s += q[r, h, d] * k[j, kh, d]
                p[j] = s
            inv = _softmax_row(p, see, see, scale)
            acc[:] = 0.0
            for j in range(see):
                for d in range(H):
                    acc[d] += p[j] * v[j, kh, d]
            for d in range(H):
                out[r, h, d] = acc[d] * inv


FEW_ROWS = 16    # below this many new rows: _few_rows_attention (serial), from it on: _attention (parallel, tiled)


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """q [m, N, H], k, v [S, K, H] (the last m keys are the new rows) -> [m, N, H]; H must be a multiple of 16."""
    if q.shape[2] % 16:
        raise ValueError(f"the numba attention kernel needs head_dim % 16 == 0, got {q.shape[2]}")
    out = np.empty(q.shape, np.float32)
    kernel = _attention if q.shape[0] >= FEW_ROWS else _few_rows_attention
    kernel(np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v), out)
    return out
