"""A decode step of a block that is not LLaMA's (Gemma 3, Qwen2, Qwen3) in two parallel regions a layer.

kernels/block_layer.py runs a layer as four Numba calls, and each call's matmul forks and joins the thread pool:
4 forks a layer, 73 a Gemma 3 step at batch 1 (docs/sliding-window.md, "Where a Gemma decode step's time goes").
A join waits for the slower thread, and beside a busy neighbour for a whole time slice. Here the threads start once
per region and meet at spin barriers (kernels/spin.py) where the next step needs every thread's results, as
kernels/decode_step.py does for LLaMA's whole step. A layer's work is cut where something outside Numba runs:

    region A (layer i)   [x += (norm of) act(i-1) @ Wdown(i-1)]  -> RMSNorm -> [Q|K|V] matmul -> Q/K norms, RoPE
    (attention: the strategy's function, masked by the layer's window)
    region B (layer i)   x += (norm of) a @ Wo -> RMSNorm -> [gate|up] matmul -> the activation's argument u
    (NumPy: np.tanh(u) or np.exp(u), in place: NumPy's own bits, as block_layer's)
    region A (head)      x += (norm of) act(L-1) @ Wdown(L-1) -> final RMSNorm -> the LM head's matmul

So a step forks 2 L + 1 times (37 for Gemma 3), and each layer's last matmul shares its fork with the next layer's
first. When the step says where its K/V live (a KVLayout: the engine's pools, local and global, or the contiguous
cache), attention needs no Python either, and a layer is one region (region_layer), L + 1 forks a step (19):

    region (layer i)     region A's steps -> the rows' K/V into their slots -> barrier -> attention, the (row,
                         query head) pairs split between the threads -> barrier -> region B's steps
    (NumPy: np.tanh(u) or np.exp(u))

Inside a region:

    every thread                         for itself, all rows: quantise the matmul's input (cheaper than a barrier)
    thread i                             output blocks [i/n, (i+1)/n) of the matmul (each column one writer; of
                                         gate|up by cost: up's blocks that take a second plane count twice)
    --- barrier ---
    every thread                         the residual row x + norm(y) into its own buffer, normed, quantised
    thread i                             its blocks of the next matmul
    --- barrier ---
    thread 0 / rows or columns dealt     x written back (no thread reads x after the barrier), Q/K norms, RoPE, u

Same bits as block_layer's calls (and so as the NumPy reference over the same tiles): every row-wise step is the
same function on the same row, the matmuls' output blocks are computed by matmul_blocks' tiles, whose every column
is the same integer dot and float scale as matmul_items' (tests/test_block_forward.py compares the two paths).

A step runs here only if its rows are few (decode: below block_layer.ROW_LOOPS_PARALLEL_FROM) and the threading
layer is `omp` (the only one that runs a parallel loop's iterations at the same time, which a barrier needs). A
barrier that times out marks the step failed; block_forward then runs the whole step again on block_layer's calls
(the K/V it wrote are rewritten with the same values) and stays there.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .block_layer import (GELU_C1, GELU_C2, PLANE_CHUNK, _rms_norm_into, _rms_norm_planes_row, _split_row,
                          plane_blocks)
from .layer import _rms_norm_quant_row
from .attention import decode_attention_heads, decode_scratch
from .matmul import (BLOCK, COLS, ROWS, _quantize_row, matmul_blocks, pairs_share_weights, thread_share,
                     weighted_share)
from .spin import barrier

NO_FLOATS = np.zeros((0, 0), np.float32)     # matmul_blocks' float32 input, which the int8 kinds never read
# a decode thread's share of gate|up: an output block that multiplies the input's second plane too (Gemma 3's up
# half) costs PLANE_COST[1] to the others' PLANE_COST[0], so the threads' shares take as long, not as many blocks
PLANE_COST = (1, 2)
# at one row both planes run as the two rows of one tile; where that tile forms each weight once for both rows (the
# 5-bit kinds: matmul.pairs_share_weights) the forming costs about as much as the multiplies, and the second plane
# adds about half (docs/sliding-window.md, "Two rows of the 5-bit tile")
PLANE_COST_ONE_ROW = (2, 3)


@njit(cache=True, inline="always")
def _quantize_rows_here(a, nb):
    """a [T, X] -> (uint8 + 128, scales [T, nb]) on the calling thread: this thread's copy of a matmul's input."""
    au, sa = np.empty(a.shape, np.uint8), np.empty((a.shape[0], nb), np.float32)
    for t in range(a.shape[0]):
        _quantize_row(a[t], au[t], sa[t])
    return au, sa


@njit(cache=True)
def _residual_then_matmul(tid, n, sync, timeout, x, y, post_norm, norm_w, eps, w_next, c_lo, c_hi, out, y2, xn,
                          acc):
    """After a barrier that completes y = f @ Wout (or x += f @ Wout when there is no post-norm): xn = x +
    rms_norm(y) (or x), then thread tid's blocks of out = quantise(rms_norm(xn, norm_w)) @ w_next, then a barrier.
    Columns c_lo .. c_hi (none if equal) add the input's second int8 plane's product (quant.two_planes): a run of
    PLANE_CHUNK blocks that holds such columns multiplies both planes as the 2T rows of one matmul into y2 [2T, O]
    (the first plane's rows, then the second's), so a tile that forms its weights in registers (the 5-bit one)
    forms each once for both; each row's product is the one a matmul of that plane alone gives. Returns False if a
    barrier failed. xn [T, D]: this thread's residual rows (written back to x by the caller)."""
    T, D = x.shape
    for t in range(T):
        if post_norm.shape[0]:
            _rms_norm_into(y[t], 0, D, post_norm, eps, xn[t], 0)      # tmp, then x + tmp: _add_normed_row's order
            for i in range(D):
                xn[t, i] = x[t, i] + xn[t, i]
        else:
            for i in range(D):
                xn[t, i] = x[t, i]
    nb = w_next.blocks.shape[0]
    p_lo, p_hi = plane_blocks(c_lo, c_hi) if c_lo < c_hi else (0, 0)
    cost = PLANE_COST_ONE_ROW if T == 1 and pairs_share_weights(w_next) else PLANE_COST
    lo, hi = weighted_share(w_next.w.shape[0], p_lo, p_hi, cost[0], cost[1], tid, n)
    xu, sx = np.empty((T, D), np.uint8), np.empty((T, nb), np.float32)
    if c_lo == c_hi:
        for t in range(T):
            _rms_norm_quant_row(xn, t, norm_w, eps, xu, sx)
        matmul_blocks(w_next, NO_FLOATS, xu, sx, out, False, lo, hi, acc)
    else:
        xu2, sx2 = np.empty((2 * T, D), np.uint8), np.empty((2 * T, nb), np.float32)   # both planes' rows
        for t in range(T):
            _rms_norm_planes_row(xn, t, norm_w, eps, xu, sx, xu2[T:], sx2[T:])
        xu2[:T] = xu
        sx2[:T] = sx
        for b0 in range(lo, hi, PLANE_CHUNK):
            b1 = min(hi, b0 + PLANE_CHUNK)
            if max(b0, p_lo) < min(b1, p_hi):
                matmul_blocks(w_next, NO_FLOATS, xu2, sx2, y2, False, b0, b1, acc)
                take_planes(y2, out, b0 * BLOCK, b1 * BLOCK, max(c_lo, b0 * BLOCK), min(c_hi, b1 * BLOCK))
            else:
                matmul_blocks(w_next, NO_FLOATS, xu, sx, out, False, b0, b1, acc)
    return barrier(sync, n, timeout)


@njit(cache=True, inline="always")
def take_planes(y2, out, b_lo, b_hi, c_lo, c_hi):
    """out[t, c] = y2[t, c] (the first plane's product) for columns b_lo .. b_hi, and for c_lo .. c_hi within them
    y2[t, c] + y2[T + t, c] (the second plane's added: block_layer.add_plane's sum, in its order)."""
    T = out.shape[0]
    for t in range(T):
        for c in range(b_lo, b_hi):
            out[t, c] = y2[t, c] + y2[T + t, c] if c_lo <= c < c_hi else y2[t, c]


@njit(cache=True)
def _f_times_w(tid, n, fu, sf, w, x, y, post_norm, acc):
    """Thread tid's blocks of y = f @ w (post-norm: y is normed and added later) or of x += f @ w (none: the add
    inside the matmul's store, as block_layer._add_residual)."""
    lo, hi = thread_share(w.w.shape[0], tid, n)
    if post_norm.shape[0]:
        matmul_blocks(w, NO_FLOATS, fu, sf, y, False, lo, hi, acc)
    else:
        matmul_blocks(w, NO_FLOATS, fu, sf, x, True, lo, hi, acc)


@njit(cache=True, error_model="numpy")
def _region_a_thread(tid, n, sync, timeout, x, tail, gu, u, gelu, wd, post_mlp, y, eps, norm_w, w_next, out,
                     split, bias, q_norm, k_norm, cos, sin, q, k, v):
    """One thread of region A: [the MLP's down half of the layer before (tail)], RMSNorm, w_next's matmul into out;
    then, if split, out's rows into q, k, v (block_layer._split_row, rows dealt round robin). False if a barrier
    failed."""
    T, D = x.shape
    acc = np.empty(ROWS * COLS * BLOCK, np.float32)
    xn = np.empty((T, D), np.float32)
    no_y2 = np.empty((0, 0), np.float32)          # (one plane: no planes' products; a global array is read-only)
    if tail:
        F = u.shape[1]
        act = np.empty((T, F), np.float32)
        for t in range(T):                        # block_layer._act_quant_row's arithmetic
            for i in range(F):
                g = gu[t, i]
                if gelu:
                    act[t, i] = np.float32(0.5) * g * (np.float32(1.0) + u[t, i]) * gu[t, F + i]
                else:
                    act[t, i] = g / (np.float32(1.0) + u[t, i]) * gu[t, F + i]
        au, sa = _quantize_rows_here(act, wd.blocks.shape[0])
        _f_times_w(tid, n, au, sa, wd, x, y, post_mlp, acc)
        if not barrier(sync, n, timeout):
            return False
        if not _residual_then_matmul(tid, n, sync, timeout, x, y, post_mlp, norm_w, eps, w_next, 0, 0, out, no_y2,
                                     xn, acc):
            return False
    else:
        empty = np.zeros(0, np.float32)
        if not _residual_then_matmul(tid, n, sync, timeout, x, y, empty, norm_w, eps, w_next, 0, 0, out, no_y2,
                                     xn, acc):
            return False
    if tid == 0 and tail:
        for t in range(T):                        # nobody reads x between the barrier and the region's join
            for i in range(D):
                x[t, i] = xn[t, i]
    if split:
        for t in range(tid, T, n):
            _split_row(out, t, bias, q_norm, k_norm, eps, cos, sin, q, k, v)
    return True


@njit(cache=True, parallel=True, error_model="numpy")
def region_a(n, sync, timeout, x, tail, gu, u, gelu, wd, post_mlp, eps, norm_w, w_next, out, split, bias, q_norm,
             k_norm, cos, sin, q, k, v):
    """x [T, D] -> (tail: x += (norm of) act(gu, u) @ wd, the previous layer's last step) -> out [T, O] =
    RMSNorm(x, norm_w) @ w_next; split: out is [Q|K|V] and its rows go into q [T, N, H], k, v [T, K, H] (bias,
    Q/K norms, RoPE at cos, sin [T, H/2]). The LM head is w_next with split False. sync: kernels/spin.py's
    counters, zeroed; FAILED set if a barrier timed out (x and out are then not to be used)."""
    y = np.empty(x.shape, np.float32)
    for tid in prange(n):                         # one iteration per thread: the threads start once per region
        _region_a_thread(np.int64(tid), n, sync, timeout, x, tail, gu, u, gelu, wd, post_mlp, y, eps, norm_w,
                         w_next, out, split, bias, q_norm, k_norm, cos, sin, q, k, v)


@njit(cache=True, error_model="numpy")
def _region_b_thread(tid, n, sync, timeout, x, a, wo, post_attn, y, eps, norm_w, wgu, c_lo, c_hi, gu, y2, gelu, u):
    """One thread of region B (see region_b); False if a barrier failed."""
    T, D = x.shape
    acc = np.empty(ROWS * COLS * BLOCK, np.float32)
    xn = np.empty((T, D), np.float32)
    au, sa = _quantize_rows_here(a, wo.blocks.shape[0])
    _f_times_w(tid, n, au, sa, wo, x, y, post_attn, acc)
    if not barrier(sync, n, timeout):
        return False
    if not _residual_then_matmul(tid, n, sync, timeout, x, y, post_attn, norm_w, eps, wgu, c_lo, c_hi, gu, y2, xn,
                                 acc):
        return False
    if tid == 0:
        for t in range(T):
            for i in range(D):
                x[t, i] = xn[t, i]
    F = u.shape[1]
    lo, hi = thread_share(F, tid, n)              # the activation's argument: this thread's columns of every row
    for t in range(T):
        for i in range(lo, hi):                   # block_layer._act_input_row's arithmetic
            g = gu[t, i]
            u[t, i] = GELU_C1 * (g + GELU_C2 * g * g * g) if gelu else -g
    return True


@njit(cache=True, parallel=True, error_model="numpy")
def region_b(n, sync, timeout, x, a, wo, post_attn, eps, norm_w, wgu, c_lo, c_hi, gu, gelu, u):
    """x += (norm of) a @ wo (a [T, N H], attention's output); gu [T, 2F] = RMSNorm(x, norm_w) @ wgu, its columns
    c_lo .. c_hi with the input's second int8 plane (quant.two_planes; c_lo = c_hi: none); u [T, F] = the
    activation's argument from the gate (block_layer.act_input). sync as in region_a."""
    y = np.empty(x.shape, np.float32)
    y2 = np.empty((2 * x.shape[0], gu.shape[1]), np.float32)  # [2T, 2F] both planes' products, up's blocks only
    for tid in prange(n):
        _region_b_thread(np.int64(tid), n, sync, timeout, x, a, wo, post_attn, y, eps, norm_w, wgu, c_lo, c_hi, gu,
                         y2, gelu, u)


@njit(cache=True)
def _attend_pairs(q, k_rows, v_rows, tables, bs, context_lens, window, lo, hi, a, fs, ints):
    """Attention for the (row, query head) pairs lo .. hi of the T * N, row-major, into a [T, N, H]: each run of
    them that shares a KV head is one decode_attention_heads call (its K/V rows read once for the run). Each head's
    arithmetic is the same whichever others share its call, so a row's output is the engine's attention's bits
    (kernels/attention.py: decode_attention_item, all g heads at once). window 0: a global layer."""
    N, g = q.shape[1], q.shape[1] // k_rows.shape[1]
    h = lo
    while h < hi:
        t, kh, r = h // N, h % N // g, h % g
        r_end = min(g, r + hi - h)
        decode_attention_heads(q, k_rows, v_rows, tables, bs, context_lens, t, kh, r, r_end, a, fs, ints, -1, 0,
                               window)
        h += r_end - r


@njit(cache=True, error_model="numpy")
def _layer_thread(tid, n, sync, timeout, x, tail, gu, u, gelu, wd, post_mlp, y, y2, eps, attn_norm, wqkv, qkv,
                  bias, q_norm, k_norm, cos, sin, q, k, v, k_rows, v_rows, tables, bs, context_lens, window, a, wo,
                  post_attn, mlp_norm, wgu, c_lo, c_hi):
    """One thread of region_layer: region A's part, the K/V of the rows it split into their slots, a barrier,
    its share of the attention heads, a barrier, region B's part."""
    if not _region_a_thread(tid, n, sync, timeout, x, tail, gu, u, gelu, wd, post_mlp, y, eps, attn_norm, wqkv, qkv,
                            True, bias, q_norm, k_norm, cos, sin, q, k, v):
        return
    K, H = k.shape[1], k.shape[2]
    for t in range(tid, x.shape[0], n):           # the rows this thread split: their K/V still in its cache
        pos = context_lens[t] - 1                 # the row's position: the last of its context
        slot = tables[t, pos // bs] * bs + pos % bs
        for h in range(K):
            for i in range(H):
                k_rows[slot, h, i] = k[t, h, i]
                v_rows[slot, h, i] = v[t, h, i]
    if not barrier(sync, n, timeout):             # the rows of a verify step (one sequence) read each other's K/V
        return
    N = q.shape[1]
    fs, ints = decode_scratch(N // K, H)
    lo, hi = thread_share(x.shape[0] * N, tid, n)  # Gemma 3 at batch 1: 4 query heads of one KV head, 2 a thread
    _attend_pairs(q, k_rows, v_rows, tables, bs, context_lens, window, lo, hi, a, fs, ints)
    if not barrier(sync, n, timeout):             # region B quantises every row of a
        return
    _region_b_thread(tid, n, sync, timeout, x, a.reshape(x.shape[0], N * H), wo, post_attn, y, eps, mlp_norm, wgu,
                     c_lo, c_hi, gu, y2, gelu, u)


@njit(cache=True, parallel=True, error_model="numpy")
def region_layer(n, sync, timeout, x, tail, gu, u, gelu, wd, post_mlp, eps, attn_norm, wqkv, qkv, bias, q_norm,
                 k_norm, cos, sin, q, k, v, k_rows, v_rows, tables, bs, context_lens, window, a, wo, post_attn,
                 mlp_norm, wgu, c_lo, c_hi):
    """A whole layer in one region when the step's K/V live where a KVLayout says: region_a (split into q, k, v),
    the rows' K/V written at slot tables[t, pos // bs] * bs + pos % bs of k_rows, v_rows [num_slots, K, H] (pos =
    context_lens[t] - 1), attention over each row's context (window > 0: its last `window` positions) into
    a [T, N, H], then region_b. sync as in region_a."""
    y = np.empty(x.shape, np.float32)
    y2 = np.empty((2 * x.shape[0], gu.shape[1]), np.float32)
    for tid in prange(n):
        _layer_thread(np.int64(tid), n, sync, timeout, x, tail, gu, u, gelu, wd, post_mlp, y, y2, eps, attn_norm,
                      wqkv, qkv, bias, q_norm, k_norm, cos, sin, q, k, v, k_rows, v_rows, tables, bs, context_lens,
                      window, a, wo, post_attn, mlp_norm, wgu, c_lo, c_hi)
