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
- float sums in another order than BLAS and its own vectorisable exp (`_softmax_row`, within 2e-7 relative of
  the true exp): results match the reference within rtol 1e-4 (as the paged kernel; tests/test_kernels.py).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .vnni import bits_float, float_bits, make_fma_microkernel

ROWS = 16                        # query rows per work item


# exp(x) = 2^(x log2 e) = 2^k * 2^f with k = round(x log2 e) and |f| <= 1/2; 2^f = e^(f ln 2) by its Taylor
# series to degree 6 (relative error < 2e-7, about float32's epsilon). Why not math.exp: LLVM can only call it
# one number at a time, and at prefill attention does ~1 M exps per layer. This form is plain arithmetic that
# LLVM turns into 16-wide SIMD; 2^k is built from its bits (exponent field k + 127).
_C = tuple(np.float32(math.log(2.0) ** i / math.factorial(i)) for i in range(7))
_LOG2E = np.float32(1.0 / math.log(2.0))


@njit(cache=True, inline="always")
def _ordered(b):
    """A float32's bits (int32) -> an int32 in the same order as the floats (negative floats count down), and back
    (the map is its own inverse)."""
    return b ^ ((b >> 31) & np.int32(0x7FFFFFFF))


@njit(cache=True, fastmath={"reassoc", "contract"})
def _softmax_row(x, see, width, scale):
    """x[:see] <- exp(scale * (x[:see] - max)), x[see:width] <- 0 (masked keys and padding); returns 1 / their sum
    (the caller scales the row of P V by it: 64 multiplies instead of `see`).

    Two passes LLVM vectorises 16 keys wide: the max as an integer max over the floats' ordered bits (a float max
    reduction stays scalar: ~5x slower here), and exp + sum in one loop ("reassoc" lets the sum run in 16 lanes,
    so it adds in another order than a plain loop; exact enough: rtol 1e-4 against the reference).
    """
    top = np.int32(-2147483647)
    for j in range(see):
        top = max(top, _ordered(float_bits(x[j])))
    shift = bits_float(_ordered(top))
    c0, c1, c2, c3, c4, c5, c6 = _C
    k2 = scale * _LOG2E
    total = np.float32(0.0)
    for j in range(see):
        t = max((x[j] - shift) * k2, np.float32(-126.0))   # e^(-87) ~ 1e-38: below it float32 has no normal numbers
        k = np.floor(t + np.float32(0.5))
        f = t - k
        y = (c0 + f * (c1 + f * (c2 + f * (c3 + f * (c4 + f * (c5 + f * c6)))))) * bits_float((np.int32(k) + 127) << 23)
        x[j] = y
        total += y
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


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """q [m, N, H], k, v [S, K, H] (the last m keys are the new rows) -> [m, N, H]; H must be a multiple of 16."""
    if q.shape[2] % 16:
        raise ValueError(f"the numba attention kernel needs head_dim % 16 == 0, got {q.shape[2]}")
    out = np.empty(q.shape, np.float32)
    _attention(np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v), out)
    return out
