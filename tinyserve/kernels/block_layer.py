"""A layer of a block that is not LLaMA's (Gemma 3, Qwen2, Qwen3) in three Numba calls, one NumPy call and attention.

kernels/layer.py fuses LLaMA's layer; this is the same idea with every switch of model.forward (ModelConfig names
them): Q/K/V biases, per-head Q/K norms, a RoPE table per layer kind, norms after attention and after the MLP, GELU
or SiLU. Each run of steps between two things Numba cannot do for us becomes one call:

    pre_attention   RMSNorm -> quantise -> [Q|K|V] matmul (+ bias) -> Q/K norms -> RoPE        x -> q, k, v
    (attention: the strategy's function, masked by the layer's window)
    post_attention  quantise(a) -> a @ Wo -> (norm) -> x += -> RMSNorm -> quantise -> [gate|up] matmul     -> gu
    act_input       u = the activation's argument: c (g + 0.044715 g^3) for GELU-tanh, -g for SiLU
    (NumPy: np.tanh(u) or np.exp(u), in place)
    mlp_down        act = gelu(g) or silu(g), times up -> quantise -> act @ Wdown -> (norm) -> x +=

Bit-identical to model.forward over the NumPy reference of the same quantised weights (quant.matmul_reference): the
integer matmuls are exact, every elementwise step is the reference's float32 operation in the reference's order,
RMSNorm's mean of squares is NumPy's pairwise summation (layer._pairwise_sum), and the one transcendental function
(tanh or exp) is NumPy's own, called between two kernels: a last-bit difference before an activation is rounded
to int8 can move it a whole int8 step. Only the int8-activation kinds (W8A8, W4A8, the byte tile) run here; W8A32
keeps kernels/block_forward.py's tiles.

The row-wise steps run serially below ROW_LOOPS_PARALLEL_FROM rows and in parallel from there on. Every parallel loop
is a fork and a join of the thread pool, and beside a busy neighbour a join waits until the partner thread gets a
core again, for a time slice (docs/sliding-window.md, "Where a decode step's time goes"): so a decode step of up to
16 rows forks only for its matmuls (4 a layer), whose weights are worth two threads, and runs the few microseconds
of its norms, RoPE and activation on the calling thread. A prefill chunk's rows are worth both threads.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .layer import _rms_norm_into, _rms_norm_quant_rows
from .matmul import BLOCK, COLS, ROWS, UNPACK_ROWS, _matmul_int8, _quantize_row, column_blocks, matmul_blocks

NO_FLOATS = np.zeros((0, 0), np.float32)     # matmul_blocks' float32 input, which the int8 kinds never read
PLANE_CHUNK = 8    # output blocks a second plane's product runs at a time: a work item, and a run of weights that
#                    is still in cache when a decode thread multiplies the second plane right after the first
ROW_LOOPS_PARALLEL_FROM = 32      # rows; a decode step (B <= 16) stays below it, a prefill chunk is above

GELU_C1 = np.float32(np.sqrt(2.0 / np.pi))   # layers.gelu_tanh's constants, the same float32 values
GELU_C2 = np.float32(0.044715)


@njit(cache=True, inline="always")
def _head_out(row, base, norm_w, eps, cos, sin, dst, tmp):
    """One head of one row: row[base:base+H] -> (its RMSNorm if norm_w has H values) -> RoPE -> dst [H]
    (layers.apply_rope's float32 operations: dimension i rotates with i + H/2)."""
    H = dst.shape[0]
    if norm_w.shape[0]:
        _rms_norm_into(row, base, H, norm_w, eps, tmp, 0)
    else:
        for i in range(H):
            tmp[i] = row[base + i]
    half = H // 2
    for i in range(half):
        x1, x2 = tmp[i], tmp[half + i]
        dst[i] = x1 * cos[i] - x2 * sin[i]
        dst[half + i] = x2 * cos[i] + x1 * sin[i]


@njit(cache=True, inline="always")
def _split_row(qkv, t, bias, q_norm, k_norm, eps, cos, sin, q, k, v):
    """Row t of qkv [T, (N + 2K) H] -> q[t] [N, H], k[t] [K, H] (bias, norm, RoPE), v[t] [K, H] (bias)."""
    N, H = q.shape[1], q.shape[2]
    K = k.shape[1]
    row = qkv[t]
    if bias.shape[0]:                                # linear(): x @ w + bias, one float32 add
        for i in range(row.shape[0]):
            row[i] = row[i] + bias[i]
    tmp = np.empty(H, np.float32)
    for h in range(N):
        _head_out(row, h * H, q_norm, eps, cos[t], sin[t], q[t, h], tmp)
    for h in range(K):
        _head_out(row, (N + h) * H, k_norm, eps, cos[t], sin[t], k[t, h], tmp)
    for h in range(K):
        for i in range(H):
            v[t, h, i] = row[(N + K + h) * H + i]


@njit(cache=True, parallel=True)
def pre_attention(x, norm_w, eps, wqkv, bias, q_norm, k_norm, cos, sin, q, k, v):
    """x [T, D] -> q [T, N, H], k [T, K, H] (normed per head, RoPE applied), v [T, K, H]. bias [(N + 2K) H] or [0];
    q_norm, k_norm [H] or [0] (the switch off); cos, sin [T, H/2] of this layer's kind."""
    T, D = x.shape
    xu, sx = np.empty((T, D), np.uint8), np.empty((T, wqkv.blocks.shape[0]), np.float32)
    _rms_norm_quant_rows(x, norm_w, eps, xu, sx, ROW_LOOPS_PARALLEL_FROM)
    qkv = np.empty((T, wqkv.w.shape[0] * 16), np.float32)                  # [T, (N + 2K) H]
    _matmul_int8(wqkv, xu, sx, qkv, False)
    if T >= ROW_LOOPS_PARALLEL_FROM:
        for t in prange(T):
            _split_row(qkv, t, bias, q_norm, k_norm, eps, cos, sin, q, k, v)
    else:
        for t in range(T):
            _split_row(qkv, t, bias, q_norm, k_norm, eps, cos, sin, q, k, v)


@njit(cache=True, inline="always")
def _add_normed_row(x, f, t, norm_w, eps):
    """x[t] = x[t] + rms_norm(f[t], norm_w): the residual add after a post-norm (Gemma 3)."""
    D = x.shape[1]
    tmp = np.empty(D, np.float32)
    _rms_norm_into(f[t], 0, D, norm_w, eps, tmp, 0)
    for i in range(D):
        x[t, i] = x[t, i] + tmp[i]


@njit(cache=True, inline="always")
def _add_residual(x, post_norm, eps, wout, au, sa):
    """x += f @ Wout, or x += rms_norm(f @ Wout, post_norm) when post_norm has D values (au, sa: f quantised)."""
    T = x.shape[0]
    if post_norm.shape[0] == 0:
        _matmul_int8(wout, au, sa, x, True)          # the add inside the matmul's store: x + (f @ W), same bits
        return
    y = np.empty(x.shape, np.float32)
    _matmul_int8(wout, au, sa, y, False)
    if T >= ROW_LOOPS_PARALLEL_FROM:
        for t in prange(T):
            _add_normed_row(x, y, t, post_norm, eps)
    else:
        for t in range(T):
            _add_normed_row(x, y, t, post_norm, eps)


@njit(cache=True, inline="always")
def _rms_norm_planes_row(x, t, weight, eps, xu, sx, xu2, sx2):
    """Row t of x [T, D] -> layers.rms_norm as two int8 planes (quant.two_planes): xu[t], sx[t] its rounding (as
    _rms_norm_quant_row's), xu2[t], sx2[t] the rounding of what that leaves (quant.activation_residual's float32
    steps). xu, xu2 [T, D] uint8 (+128); sx, sx2 [T, nb]."""
    D = x.shape[1]
    nb = sx.shape[1]
    kb = D // nb
    h = np.empty(D, np.float32)
    _rms_norm_into(x[t], 0, D, weight, eps, h, 0)
    _quantize_row(h, xu[t], sx[t])
    for b in range(nb):
        lo, s = b * kb, sx[t, b]
        for i in range(kb):                          # (indexed lo + i, as in matmul._quantize_row)
            h[lo + i] = h[lo + i] - np.float32(np.int32(xu[t, lo + i]) - 128) * s
    _quantize_row(h, xu2[t], sx2[t])


@njit(cache=True, inline="always")
def add_plane(y2, out, c_lo, c_hi):
    """out[:, c] = out[:, c] + y2[:, c] for columns c_lo .. c_hi: quant.two_planes' sum, in its order."""
    for t in range(out.shape[0]):
        for c in range(c_lo, c_hi):
            out[t, c] = out[t, c] + y2[t, c]


@njit(cache=True, inline="always")
def plane_blocks(c_lo, c_hi):
    """The output blocks (of BLOCK columns) that hold columns c_lo .. c_hi."""
    return c_lo // BLOCK, (c_hi + BLOCK - 1) // BLOCK


@njit(cache=True, inline="always")
def _norm_matmul(x, norm_w, eps, w, c_lo, c_hi, out):
    """out [T, O] = RMSNorm(x) @ w, its input one int8 plane; the columns c_lo .. c_hi (none if equal) plus the
    second plane's product (quant.two_planes: Gemma 3's up half of gate|up)."""
    T, D = x.shape
    nb = w.blocks.shape[0]
    xu, sx = np.empty((T, D), np.uint8), np.empty((T, nb), np.float32)
    if c_lo == c_hi:
        _rms_norm_quant_rows(x, norm_w, eps, xu, sx, ROW_LOOPS_PARALLEL_FROM)
        _matmul_int8(w, xu, sx, out, False)
        return
    xu2, sx2 = np.empty((T, D), np.uint8), np.empty((T, nb), np.float32)
    if T >= ROW_LOOPS_PARALLEL_FROM:
        for t in prange(T):
            _rms_norm_planes_row(x, t, norm_w, eps, xu, sx, xu2, sx2)
    else:
        for t in range(T):
            _rms_norm_planes_row(x, t, norm_w, eps, xu, sx, xu2, sx2)
    _matmul_int8(w, xu, sx, out, False)
    b_lo, b_hi = plane_blocks(c_lo, c_hi)
    if T >= UNPACK_ROWS:           # a prefill: the plane's blocks as a matmul of their own (5-bit ones on bytes)
        y2 = np.empty((T, (b_hi - b_lo) * BLOCK), np.float32)
        _matmul_int8(column_blocks(w, b_lo, b_hi), xu2, sx2, y2, False)
        for t in prange(T):
            for c in range(c_lo, c_hi):
                out[t, c] = out[t, c] + y2[t, c - b_lo * BLOCK]
        return
    y2 = np.empty(out.shape, np.float32)                  # the second plane's product, its blocks only
    n = (b_hi - b_lo + PLANE_CHUNK - 1) // PLANE_CHUNK
    for g in prange(n):
        lo, hi = b_lo + g * PLANE_CHUNK, min(b_hi, b_lo + (g + 1) * PLANE_CHUNK)
        acc = np.empty(ROWS * COLS * BLOCK, np.float32)
        matmul_blocks(w, NO_FLOATS, xu2, sx2, y2, False, lo, hi, acc)
        add_plane(y2, out, max(c_lo, lo * BLOCK), min(c_hi, hi * BLOCK))


@njit(cache=True, parallel=True)
def post_attention(x, a, wo, post_norm, norm_w, eps, wgu, gu, c_lo, c_hi):
    """x += (norm of) a @ Wo (a [T, N H], the attention output); then gu [T, 2F] = RMSNorm(x) @ [Wgate | Wup], its
    columns c_lo .. c_hi with the input's second int8 plane (quant.two_planes; c_lo = c_hi: none)."""
    T = a.shape[0]
    au, sa = np.empty(a.shape, np.uint8), np.empty((T, wo.blocks.shape[0]), np.float32)
    if T >= ROW_LOOPS_PARALLEL_FROM:
        for t in prange(T):
            _quantize_row(a[t], au[t], sa[t])
    else:
        for t in range(T):
            _quantize_row(a[t], au[t], sa[t])
    _add_residual(x, post_norm, eps, wo, au, sa)
    _norm_matmul(x, norm_w, eps, wgu, c_lo, c_hi, gu)


@njit(cache=True, inline="always")
def _act_input_row(gu, t, gelu, u):
    F = u.shape[1]
    for i in range(F):
        g = gu[t, i]
        u[t, i] = GELU_C1 * (g + GELU_C2 * g * g * g) if gelu else -g


@njit(cache=True, parallel=True)
def act_input(gu, gelu, u):
    """u [T, F] = the argument of the activation's transcendental function, from the gate gu[:, :F]: layers.gelu_tanh's
    c1 (g + c2 g g g) (then tanh), or layers.silu's -g (then exp)."""
    if u.shape[0] >= ROW_LOOPS_PARALLEL_FROM:
        for t in prange(u.shape[0]):
            _act_input_row(gu, t, gelu, u)
    else:
        for t in range(u.shape[0]):
            _act_input_row(gu, t, gelu, u)


@njit(cache=True, inline="always")
def _act_quant_row(gu, u, t, gelu, au, sa):
    """act = gelu(g) * up = 0.5 g (1 + tanh) * up, or silu(g) * up = g / (1 + exp(-g)) * up, quantised into au[t]."""
    F = u.shape[1]
    act = np.empty(F, np.float32)
    for i in range(F):
        g = gu[t, i]
        if gelu:
            act[i] = np.float32(0.5) * g * (np.float32(1.0) + u[t, i]) * gu[t, F + i]
        else:
            act[i] = g / (np.float32(1.0) + u[t, i]) * gu[t, F + i]
    _quantize_row(act, au[t], sa[t])


@njit(cache=True, parallel=True, error_model="numpy")
def mlp_down(x, gu, u, gelu, wd, post_norm, eps):
    """x += (norm of) (act(gate) * up) @ Wdown; u: tanh or exp of act_input's u (NumPy's)."""
    T, F = u.shape
    au, sa = np.empty((T, F), np.uint8), np.empty((T, wd.blocks.shape[0]), np.float32)
    if T >= ROW_LOOPS_PARALLEL_FROM:
        for t in prange(T):
            _act_quant_row(gu, u, t, gelu, au, sa)
    else:
        for t in range(T):
            _act_quant_row(gu, u, t, gelu, au, sa)
    _add_residual(x, post_norm, eps, wd, au, sa)
