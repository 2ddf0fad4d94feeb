"""A W8A8 (or W4A8) LLaMA layer in three Numba calls (plus attention).

At decode a layer is about ten small steps (norm, quantise, matmul, RoPE, ...), each a few microseconds of work;
called one by one from Python they cost more in call overhead than in arithmetic. Here each run of steps between
two things Numba cannot do for us becomes one call:

    pre_attention   RMSNorm -> quantise -> [Q|K|V] matmul -> RoPE             x -> q, k, v
    (attention: the strategy's function: KV cache, paged blocks, ...)
    post_attention  quantise(a) -> x += a @ Wo -> RMSNorm -> quantise -> [gate|up] matmul      -> gu
    mlp_down        e = exp(-gate) -> silu(gate) * up -> quantise -> x += act @ Wdown

Bit-identical to the NumPy W8A8 reference (tinyserve.quant through model.forward): the integer matmuls are exact,
the elementwise steps are the reference's float32 operations in the reference's order, RMSNorm's mean of squares
is NumPy's own pairwise summation (`_pairwise_sum`), and SiLU's exp is NumPy's when kernels.forward.silu_exp = np.exp
(a last-bit difference before rounding to int8 can become a whole int8 step). By default mlp_down computes it with
fast_exp.exp32, as the fused decode step does (forward.py says why).
The row-wise steps run serially at decode (one row) and in parallel at prefill. The same functions run W4A8
(quant.py's 4-bit mode): each matrix arrives as its packed kind (matmul.W8A8Weights or W4A8Weights), and the matmul
they call (matmul._matmul_int8) compiles the tile of that kind.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .fast_exp import exp32
from .matmul import PARALLEL_ROWS, _matmul_int8, _matmul_w8a32_auto, _quantize_row, split_rope_row


@njit(cache=True)
def _block_sum(a, lo, n):
    """NumPy's sum of a run of n <= 128 float32: 8 running sums, combined as a tree, then the tail."""
    if n < 8:
        res = np.float32(0.0)
        for i in range(n):
            res += a[lo + i]
        return res
    # eight scalars, not a small array: LLVM keeps them in one vector register (an array it would leave in memory)
    r0, r1, r2, r3, r4, r5, r6, r7 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3], a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    i = 8
    while i < n - n % 8:
        b = lo + i
        r0, r1, r2, r3 = r0 + a[b], r1 + a[b + 1], r2 + a[b + 2], r3 + a[b + 3]
        r4, r5, r6, r7 = r4 + a[b + 4], r5 + a[b + 5], r6 + a[b + 6], r7 + a[b + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[lo + i]
        i += 1
    return res


@njit(cache=True)
def _pairwise_sum(a, lo, n):
    """sum(a[lo:lo+n]) exactly as NumPy adds a contiguous float32 run (np.add.reduce): runs of > 128 are split in
    halves (the first a multiple of 8 long) and the two sums added; shorter runs go to _block_sum. NumPy recurses;
    this walks the same tree with an explicit stack (Numba's recursion does not survive inlining into parallel
    kernels). Tested equal to NumPy on random rows (tests/test_kernels.py)."""
    f_lo, f_n, f_stage = np.empty(64, np.int64), np.empty(64, np.int64), np.empty(64, np.int64)
    vals = np.empty(64, np.float32)
    f_lo[0], f_n[0], f_stage[0] = lo, n, 0
    sp, vp = 1, 0
    while sp > 0:
        top = sp - 1
        lo_, n_ = f_lo[top], f_n[top]
        if n_ <= 128:
            vals[vp] = _block_sum(a, lo_, n_)
            vp += 1
            sp -= 1
            continue
        n2 = n_ // 2
        n2 -= n2 % 8
        if f_stage[top] == 0:                      # left half first
            f_stage[top] = 1
            f_lo[sp], f_n[sp], f_stage[sp] = lo_, n2, 0
            sp += 1
        elif f_stage[top] == 1:                    # then the right half
            f_stage[top] = 2
            f_lo[sp], f_n[sp], f_stage[sp] = lo_ + n2, n_ - n2, 0
            sp += 1
        else:                                      # both done: left + right
            vals[vp - 2] = vals[vp - 2] + vals[vp - 1]
            vp -= 1
            sp -= 1
    return vals[0]


@njit(cache=True, inline="always")
def _rms_norm_into(src, lo, n, weight, eps, dst, dlo):
    """dst[dlo:dlo+n] = layers.rms_norm(src[lo:lo+n], weight): the mean of squares as NumPy sums it."""
    sq = np.empty(n, np.float32)
    for i in range(n):
        sq[i] = src[lo + i] * src[lo + i]
    ms = _pairwise_sum(sq, 0, n) / np.float32(n)
    inv = np.float32(1.0) / np.sqrt(ms + eps)
    for i in range(n):
        dst[dlo + i] = src[lo + i] * inv * weight[i]


@njit(cache=True, inline="always")
def _rms_norm_quant_row(x, t, weight, eps, xu, sx):
    """layers.rms_norm then quant.quantize_blocks for row t: x [T, D] -> xu[t] [D] uint8 (+128), sx[t] [nb]."""
    D = x.shape[1]
    h = np.empty(D, np.float32)
    _rms_norm_into(x[t], 0, D, weight, eps, h, 0)
    _quantize_row(h, xu[t], sx[t])


@njit(cache=True, inline="always")
def _swiglu_quant_row(gu, e, t, au, sa):
    """silu(gate) * up for row t (gu [T, 2F] = gate | up, e = exp(-gate)), quantised into au[t], sa[t]."""
    F = e.shape[1]
    act = np.empty(F, np.float32)
    for i in range(F):
        act[i] = gu[t, i] / (np.float32(1.0) + e[t, i]) * gu[t, F + i]
    _quantize_row(act, au[t], sa[t])


# Each row-wise step below runs serially at decode (a parallel launch costs more than one row's work) and in
# parallel from PARALLEL_ROWS rows on (prefill: ~15 % of a layer's time when serial).

@njit(cache=True, inline="always")
def _rms_norm_quant_rows(x, weight, eps, xu, sx, parallel_from):
    """_rms_norm_quant_row for every row of x [T, D]: in a parallel loop from parallel_from rows on, else on the
    calling thread (this module passes PARALLEL_ROWS, block_layer.py its ROW_LOOPS_PARALLEL_FROM)."""
    if x.shape[0] >= parallel_from:
        for t in prange(x.shape[0]):
            _rms_norm_quant_row(x, t, weight, eps, xu, sx)
    else:
        for t in range(x.shape[0]):
            _rms_norm_quant_row(x, t, weight, eps, xu, sx)


@njit(cache=True, parallel=True)
def pre_attention(x, norm_w, eps, wqkv, cos, sin, n_heads, n_kv_heads, q, k, v):
    """x [T, D] -> q [T, N, H], k [T, K, H] (RoPE applied), v [T, K, H]. wqkv.blocks [nb, 0]: the activations get nb
    scales per row (matmul.W8A8Weights)."""
    T, D = x.shape
    xu, sx = np.empty((T, D), np.uint8), np.empty((T, wqkv.blocks.shape[0]), np.float32)
    _rms_norm_quant_rows(x, norm_w, eps, xu, sx, PARALLEL_ROWS)
    qkv = np.empty((T, wqkv.w.shape[0] * 16), np.float32)                  # [T, (N + 2K) H]
    _matmul_int8(wqkv, xu, sx, qkv, False)
    if T >= PARALLEL_ROWS:
        for t in prange(T):
            split_rope_row(qkv, cos, sin, n_heads, n_kv_heads, q, k, v, t)     # layers.apply_rope
    else:
        for t in range(T):
            split_rope_row(qkv, cos, sin, n_heads, n_kv_heads, q, k, v, t)


@njit(cache=True, parallel=True)
def post_attention(x, a, wo, norm_w, eps, wgu, gu):
    """x += a @ Wo (a [T, N H], the attention output), then gu [T, 2F] = RMSNorm(x) @ [Wgate | Wup]."""
    T = a.shape[0]
    au, sa = np.empty(a.shape, np.uint8), np.empty((T, wo.blocks.shape[0]), np.float32)
    if T >= PARALLEL_ROWS:
        for t in prange(T):
            _quantize_row(a[t], au[t], sa[t])
    else:
        for t in range(T):
            _quantize_row(a[t], au[t], sa[t])
    _matmul_int8(wo, au, sa, x, True)
    xu, sx = np.empty(x.shape, np.uint8), np.empty((T, wgu.blocks.shape[0]), np.float32)
    _rms_norm_quant_rows(x, norm_w, eps, xu, sx, PARALLEL_ROWS)
    _matmul_int8(wgu, xu, sx, gu, False)


# SiLU divides by 1 + e^-g, a different number for every element. Numba's default error model checks every such
# division for zero (to raise ZeroDivisionError like Python), and that branch keeps LLVM from vectorising the loop:
# several times slower per row than under NumPy's model (a zero divisor gives inf, as in NumPy; here it cannot be
# zero), with the same float32 divisions and the same bits (docs/performance.md, "Why the kernels' constants are what
# they are").
SWIGLU_KERNEL = dict(cache=True, parallel=True, error_model="numpy")


@njit(cache=True, inline="always")
def _neg_exp_row(gu, t, e):
    """e[t] = exp32(-gate) for row t: the fused decode step's SiLU exp (kernels/decode_step.py), element for element."""
    for i in range(e.shape[1]):
        e[t, i] = exp32(-gu[t, i])


@njit(**SWIGLU_KERNEL)
def mlp_down(x, gu, e, exp_here, wd):
    """x += (silu(gate) * up) @ Wdown, silu(g) = g / (1 + e) with e = exp(-gate): computed here with fast_exp.exp32
    when exp_here (the default, forward.silu_exp = None), else given (NumPy's exp: the reference's bits)."""
    T, F = e.shape
    au, sa = np.empty((T, F), np.uint8), np.empty((T, wd.blocks.shape[0]), np.float32)
    if T >= PARALLEL_ROWS:
        for t in prange(T):
            if exp_here:
                _neg_exp_row(gu, t, e)
            _swiglu_quant_row(gu, e, t, au, sa)
    else:
        for t in range(T):
            if exp_here:
                _neg_exp_row(gu, t, e)
            _swiglu_quant_row(gu, e, t, au, sa)
    _matmul_int8(wd, au, sa, x, True)


@njit(cache=True, parallel=True)
def lm_head(x, norm_w, eps, w):
    """logits [R, V] = RMSNorm(x) @ W_head for the R rows that sample."""
    xu, sx = np.empty(x.shape, np.uint8), np.empty((x.shape[0], w.blocks.shape[0]), np.float32)
    _rms_norm_quant_rows(x, norm_w, eps, xu, sx, PARALLEL_ROWS)
    out = np.empty((x.shape[0], w.w.shape[0] * 16), np.float32)
    _matmul_int8(w, xu, sx, out, False)
    return out


# --- W8A32 (int8 weights, float32 activations): the same three calls per layer ----------------------------------
# Nothing to keep bit-identical here (the W8A32 matmuls already sum in another order than BLAS), so the norm sums in
# float64 and SiLU uses fast_exp's exp: within ~1e-6 relative of the NumPy reference (tests/test_quant.py). What
# fusing buys is the same as for W8A8: at decode, ~20 NumPy calls and 9 kernel launches per layer become 3 calls.

@njit(cache=True, inline="always")
def _rms_norm_row(x, t, weight, eps, h):
    """layers.rms_norm for row t: x [T, D] -> h[t] (the mean of squares summed in float64)."""
    D = x.shape[1]
    ss = 0.0
    for i in range(D):
        ss += np.float64(x[t, i]) * np.float64(x[t, i])
    inv = np.float32(1.0) / np.sqrt(np.float32(ss / D) + eps)
    for i in range(D):
        h[t, i] = x[t, i] * inv * weight[i]


@njit(cache=True, inline="always")
def _rms_norm_rows(x, weight, eps):
    h = np.empty(x.shape, np.float32)
    if x.shape[0] >= PARALLEL_ROWS:
        for t in prange(x.shape[0]):
            _rms_norm_row(x, t, weight, eps, h)
    else:
        for t in range(x.shape[0]):
            _rms_norm_row(x, t, weight, eps, h)
    return h


@njit(cache=True, inline="always")
def _swiglu_row(gu, t, act):
    """act[t] = silu(gate) * up for row t of gu [T, 2F] = gate | up; silu(g) = g / (1 + e^-g)."""
    F = act.shape[1]
    for i in range(F):
        g = gu[t, i]
        act[t, i] = g / (np.float32(1.0) + exp32(-g)) * gu[t, F + i]


@njit(cache=True, parallel=True)
def pre_attention_w8a32(x, norm_w, eps, wqkv, cos, sin, n_heads, n_kv_heads, q, k, v):
    """x [T, D] -> q [T, N, H], k [T, K, H] (RoPE applied), v [T, K, H]."""
    T = x.shape[0]
    h = _rms_norm_rows(x, norm_w, eps)
    qkv = np.empty((T, wqkv.w.shape[0] * 16), np.float32)                  # [T, (N + 2K) H]
    _matmul_w8a32_auto(wqkv, h, qkv, False)
    if T >= PARALLEL_ROWS:
        for t in prange(T):
            split_rope_row(qkv, cos, sin, n_heads, n_kv_heads, q, k, v, t)
    else:
        for t in range(T):
            split_rope_row(qkv, cos, sin, n_heads, n_kv_heads, q, k, v, t)


@njit(cache=True, parallel=True)
def post_attention_w8a32(x, a, wo, norm_w, eps, wgu, gu):
    """x += a @ Wo, then gu [T, 2F] = RMSNorm(x) @ [Wgate | Wup]."""
    _matmul_w8a32_auto(wo, a, x, True)
    _matmul_w8a32_auto(wgu, _rms_norm_rows(x, norm_w, eps), gu, False)


@njit(**SWIGLU_KERNEL)
def mlp_down_w8a32(x, gu, wd):
    """x += (silu(gate) * up) @ Wdown."""
    T, F = x.shape[0], gu.shape[1] // 2
    act = np.empty((T, F), np.float32)
    if T >= PARALLEL_ROWS:
        for t in prange(T):
            _swiglu_row(gu, t, act)
    else:
        for t in range(T):
            _swiglu_row(gu, t, act)
    _matmul_w8a32_auto(wd, act, x, True)


@njit(cache=True, parallel=True)
def lm_head_w8a32(x, norm_w, eps, w):
    """logits [R, V] = RMSNorm(x) @ W_head for the R rows that sample."""
    out = np.empty((x.shape[0], w.w.shape[0] * 16), np.float32)
    _matmul_w8a32_auto(w, _rms_norm_rows(x, norm_w, eps), out, False)
    return out
