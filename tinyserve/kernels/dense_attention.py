"""Causal attention over a contiguous KV cache in Numba: gqa.grouped_attention's arrays in and out.

The kv_cache strategy (lessons 2-3) on the numba backend uses it. At prefill it is the part of the step that is
not a weight matmul: 512 new rows over 512 keys is ~9 GFLOP for SmolLM2's 30 layers, which NumPy does with
single-threaded BLAS (the numba backend keeps BLAS at one thread, see kernels/__init__.py) plus a softmax over the
full S x S square, half of which the causal mask throws away.

What it does differently from the NumPy reference:
- work items are (query head, block of ROWS query rows), run in parallel; a block computes scores only for the
  keys its last row can see (the causal mask skips the rest instead of computing and discarding it);
- Q K^T and P V run on the register-tiled FMA microkernel (kernels/vnni.py), K transposed once per call so a
  tile's 64 keys are contiguous;
- float sums in another order than BLAS and its own vectorisable exp (`_exp_shifted`, within 2e-7 relative of
  the true exp): results match the reference within rtol 1e-4 (as the paged kernel; tests/test_kernels.py).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .vnni import make_fma_microkernel

ROWS = 16                        # query rows per work item
LANES = 16                       # partial sums of a softmax row: a vector register's worth


# exp(x) = 2^(x log2 e) = 2^k * 2^f with k = round(x log2 e) and |f| <= 1/2; 2^f = e^(f ln 2) by its Taylor
# series to degree 6 (relative error < 2e-7, about float32's epsilon). Why not math.exp: LLVM can only call it
# one number at a time, and at prefill attention does ~1 M exps per layer. This form is plain arithmetic that
# LLVM turns into 16-wide SIMD; 2^k is built from its bits (exponent field k + 127) through an int32 view.
_C = tuple(np.float32(math.log(2.0) ** i / math.factorial(i)) for i in range(7))
_LOG2E = np.float32(1.0 / math.log(2.0))


@njit(cache=True, inline="always")
def _exp_shifted(x, n, shift, bits):
    """x[:n] <- exp(x[:n] - shift) for x - shift <= 0 (the softmax's shifted scores); returns their sum.
    bits: int32 scratch of >= n elements."""
    c0, c1, c2, c3, c4, c5, c6 = _C
    for j in range(n):
        t = (x[j] - shift) * _LOG2E
        if t < -126.0:
            t = np.float32(-126.0)                  # e^(-87) ~ 1e-38: below it float32 has no normal numbers
        k = math.floor(t + np.float32(0.5))
        f = t - np.float32(k)
        x[j] = c0 + f * (c1 + f * (c2 + f * (c3 + f * (c4 + f * (c5 + f * c6)))))
        bits[j] = (np.int32(k) + 127) << 23
    pow2 = bits.view(np.float32)
    part = np.zeros(LANES, np.float32)
    for j0 in range(0, n - n % LANES, LANES):       # 16 running sums (vectorisable), then one total
        for lane in range(LANES):
            x[j0 + lane] *= pow2[j0 + lane]
            part[lane] += x[j0 + lane]
    total = np.float32(0.0)
    for j in range(n - n % LANES, n):
        x[j] *= pow2[j]
        total += x[j]
    for lane in range(LANES):
        total += part[lane]
    return total
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
    for j in range(S):
        for kh in range(K):
            for d in range(H):
                kt[kh, d, j] = k[j, kh, d]
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
        bits = np.empty(width, np.int32)
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
        for rr in range(nr):                                   # softmax over the keys row rr may see
            see = S - m + r0 + rr + 1
            mx = np.float32(-np.inf)
            for j in range(see):
                p[rr, j] *= scale
                mx = max(mx, p[rr, j])
            total = _exp_shifted(p[rr], see, mx, bits)
            inv = np.float32(1.0) / total
            for j in range(see):
                p[rr, j] *= inv
            for j in range(see, width):
                p[rr, j] = 0.0                                 # masked: future keys and padding
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


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """q [m, N, H], k, v [S, K, H] (the last m keys are the new rows) -> [m, N, H]; H must be a multiple of 16."""
    if q.shape[2] % 16:
        raise ValueError(f"the numba attention kernel needs head_dim % 16 == 0, got {q.shape[2]}")
    out = np.empty(q.shape, np.float32)
    _attention(np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v), out)
    return out
