"""int8 matmuls in Numba: y[T, O] = x[T, D] @ W (W int8 with one float scale per output channel).

Three kernels, one per kind of quantisation in tinyserve.quant:
- `matmul_w8a8`: the activations are quantised too (int8 per row, by `quantize_rows` or fused into
  the fused layer of kernels/layer.py), so the dot products are integer: the int8 tile of this CPU's instruction
  set (kernels/int8_dot.py: vpdpbusd, vpmaddubsw + vpmaddwd, sdot or plain loops) over weights packed by
  `pack_vnni`. Bit-identical to the NumPy reference in tinyserve.quant (integer sums; the
  same float32 scaling in the same order).
- `matmul_w8a32`: weight-only; each int8 weight is widened to float32 and multiplied with the float32 activation.
  Float sums in a different order than BLAS: matches the NumPy reference to ~1e-6 relative (tests/test_quant.py).
- `matmul_w4a8`: Q4_1 weights (4 bits, a scale and a minimum per 32 inputs; `pack_w4a8`) times int8 activations
  per 32, the tile of kernels/int4_dot.py; bit-identical to quant.matmul_reference_w4a8. The same with whole bytes
  (0..255, `pack_b8a8`): the byte tile, which runs the GGUF formats of 8 bits and what mixes formats (quant.py's
  "gguf" mode); with 5-bit values (`pack_q5a8`): the 5-bit tile (Q5_0, Q5_1, Q5_K).

Inside, a packed matrix is one of nine NamedTuples, W8A8Weights, W8A32Weights, W4A8Weights, S4A8Weights (W4A8's
nibbles without the minimum, for Q4_0), Q6A8Weights (Q6_K's own blocks), B8A8Weights, S8A8Weights (bytes without
the minimum, for Q8_0), Q5A8Weights and S5A8Weights (5-bit values with and without the minimum): its class is its
kind, and the kind picks the tile when Numba compiles a matmul. Every kind is walked by the same two drivers
(`matmul_items`, `matmul_blocks`, at the end of this file) over work items of (a tile of rows, a group of 64 output
channels), so one weight group is read from memory once per tile of rows and stays in cache while the other rows'
tiles reuse it: at decode (T = 1..16) the kernels stream the weights once (memory-bound), at prefill (T = hundreds)
they are compute-bound.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit, prange
from numba.extending import overload

from .int4_dot import (BYTE_GROUP_BYTES, FIVE_BITS_BYTES, FIVE_MIN_PER_D, GROUP, GROUP_BYTES, Q5_GROUP_BYTES,
                       Q6_GROUP_BYTES, Q6_SC_BYTES, Q6_SUPER, Q6_SUPER_BYTES, Q6B_GROUP_BYTES, Q6B_SUPER_BYTES,
                       SYM_BYTE_GROUP_BYTES, SYM_GROUP_BYTES, SYM_Q5_GROUP_BYTES, make_w4a8_tile)
from .int8_dot import make_int8_tile
from .simd import bits_float, float_bits, make_fma_microkernel

BLOCK = 16            # output channels per packed block: one vector of 16 int32 accumulators
ROWS = 4              # R: rows (tokens) per tile: each weight load serves 4 rows
COLS = 4              # C: packed blocks per tile: each activation broadcast serves 4 x 16 = 64 outputs
WIDE_ROWS = 6         # W8A32 prefill tile: 6 x 4 accumulators + 4 weight vectors of the 32 registers
WIDE_CHUNK = 288      # W8A32 prefill: rows per work item (a multiple of WIDE_ROWS; smaller chunks widen more often)
WIDE_MIN_ROWS = 32    # from this many rows on, W8A32 widens each weight group once instead of in every tile


# the int8 tiles of this CPU's instruction set (isa.NAME): a full work item, one row of it, one block
_tile_RC, _tile_1C, _tile_11 = make_int8_tile(ROWS, COLS), make_int8_tile(1, COLS), make_int8_tile(1, 1)
_ftile_RC = make_fma_microkernel(ROWS, COLS, b_int8=True)
_ftile_1C = make_fma_microkernel(1, COLS, b_int8=True)
_ftile_11 = make_fma_microkernel(1, 1, b_int8=True)
_wide_RC = make_fma_microkernel(WIDE_ROWS, COLS, b_int8=False)     # prefill: weights widened once (see below)
_wide_1C = make_fma_microkernel(1, COLS, b_int8=False)
_wide_11 = make_fma_microkernel(1, 1, b_int8=False)


# --- layout ------------------------------------------------------------------------------------------------------

def pack_vnni(wq: np.ndarray) -> np.ndarray:
    """[D, O] int8 (y = x @ W) -> [O/16, D/4 * 64] int8: block b, step i holds outputs 16b..16b+15 x inputs 4i..4i+3,
    output-major (byte 4*l + k is W[4i + k, 16b + l]): exactly one vpdpbusd operand per 64 bytes."""
    D, O = wq.shape
    if D % 4 or O % BLOCK:
        raise ValueError(f"pack_vnni needs D % 4 == 0 and O % {BLOCK} == 0, got a [{D}, {O}] matrix")
    w = wq.reshape(D // 4, 4, O // BLOCK, BLOCK)          # [i, k, b, l]
    return np.ascontiguousarray(w.transpose(2, 0, 3, 1)).reshape(O // BLOCK, D // 4 * 4 * BLOCK)


def block_sums(wq: np.ndarray, n_blocks: int) -> np.ndarray:
    """[D, O] int8 -> [n_blocks, O] int32: each output's weights summed over each run of D / n_blocks inputs: what a
    W8A8 matmul whose activations carry + 128 subtracts, 128 times it (matmul_w8a8's contract, lesson 7)."""
    D, O = wq.shape
    return wq.reshape(n_blocks, D // n_blocks, O).sum(axis=1, dtype=np.int32)


def pack_w8a32(wq: np.ndarray) -> np.ndarray:
    """[D, O] int8 -> [O/16, D, 16] int8: for each input channel, the 16 outputs of a block side by side, so the
    weight-only kernel widens 16 contiguous bytes and multiplies them with one broadcast activation."""
    D, O = wq.shape
    if O % BLOCK:
        raise ValueError(f"pack_w8a32 needs O % {BLOCK} == 0, got a [{D}, {O}] matrix")
    return np.ascontiguousarray(wq.reshape(D, O // BLOCK, BLOCK).transpose(1, 0, 2))


# --- the packed weights' kinds -------------------------------------------------------------------------------------
# A packed matrix says what it is by its class: the matmuls below pick their tile from it when Numba compiles them
# (one branch per kind, no test of a shape or a flag at run time). The three have the same fields, so code that only
# moves weights around (stacking the layers, taking one layer) treats them alike. With a leading L axis on every
# array they hold a matrix of every layer at once (kernels/forward.py stacks them for the fused decode step).
# `blocks` is an empty array whose first axis is nb, the activation scales a row of the matrix's input has: the
# drivers size their scratch by it without a separate integer field (which could not be stacked).


def act_blocks_of(nb: int) -> np.ndarray:
    """A kind's `blocks`: [nb, 0] int32, only its shape is read."""
    return np.zeros((nb, 0), np.int32)


class W8A8Weights(NamedTuple):
    """int8 weights times int8 activations (QuantMode.kernels == "w8a8"; also a W4A8 model's LM head)."""
    w: np.ndarray          # [O/16, D/4 * 64] int8: pack_vnni
    blocks: np.ndarray     # [nb, 0] int32: nb activation scales per row (act_blocks_of)
    scale: np.ndarray      # [O] float32


class W8A32Weights(NamedTuple):
    """int8 weights times float32 activations (QuantMode.kernels == "w8a32")."""
    w: np.ndarray          # [O/16, D, 16] int8: pack_w8a32
    blocks: np.ndarray     # [1, 0] int32 (the float32 activations have no scales: unread)
    scale: np.ndarray      # [O] float32


class W4A8Weights(NamedTuple):
    """Q4_1 weights (4 bits, a float16 scale and minimum per 32 inputs) times int8 activations (QuantMode.kernels
    == "w4a8"). The weights' scales travel inside w."""
    w: np.ndarray          # [O/16, D/32, 320] uint8: pack_w4a8
    blocks: np.ndarray     # [D/32, 0] int32: one activation scale per 32 inputs
    scale: np.ndarray      # [0] float32


class S4A8Weights(NamedTuple):
    """Nibble blocks without a minimum (Q4_0: w = d (q - 8), so m = -8 d, which the tile forms from d) times int8
    activations: the W4A8 tile reading 18 bytes per 32 weights instead of 20 (QuantMode "gguf"). Scales inside w."""
    w: np.ndarray          # [O/16, D/32, 288] uint8: pack_s4a8
    blocks: np.ndarray     # [D/32, 0] int32: one activation scale per 32 inputs
    scale: np.ndarray      # [0] float32


class Q6A8Weights(NamedTuple):
    """Q6_K's own blocks (6-bit q with offset 32, an int8 scale per 16 inputs, a float16 d per 256) times int8
    activations per 32: the 6-bit tile (int4_dot.make_w4a8_tile(six_bits=True)), 6.5625 bits a weight as the file
    has them. Scales inside w."""
    w: np.ndarray          # [O/16, D/256, 3360] uint8: pack_q6a8
    blocks: np.ndarray     # [D/32, 0] int32: one activation scale per 32 inputs
    scale: np.ndarray      # [0] float32


class B8A8Weights(NamedTuple):
    """Whole-byte weights (0..255, a float16 scale and minimum per 32 inputs: w = d * q + m) times int8 activations:
    the GGUF formats of 5 to 8 bits (QuantMode "gguf"), the W4A8 tile's arithmetic on bytes. Scales inside w."""
    w: np.ndarray          # [O/16, D/32, 576] uint8: pack_b8a8
    blocks: np.ndarray     # [D/32, 0] int32: one activation scale per 32 inputs
    scale: np.ndarray      # [0] float32


class S8A8Weights(NamedTuple):
    """Whole-byte blocks whose minimum is -128 d (Q8_0: q + 128 with w = d (q - 128)), d only: the byte tile reading
    34 bytes per 32 weights, Q8_0's own, instead of 36; the tile forms m = -128 d (exact). Scales inside w."""
    w: np.ndarray          # [O/16, D/32, 544] uint8: pack_s8a8
    blocks: np.ndarray     # [D/32, 0] int32: one activation scale per 32 inputs
    scale: np.ndarray      # [0] float32


class Q5A8Weights(NamedTuple):
    """5-bit blocks (0..31, a float16 scale and minimum per 32 inputs: Q5_1, Q5_K) times int8 activations: the 5-bit
    tile, 6 bits a weight as the file's Q5_1. Scales inside w."""
    w: np.ndarray          # [O/16, D/32, 384] uint8: pack_q5a8
    blocks: np.ndarray     # [D/32, 0] int32: one activation scale per 32 inputs
    scale: np.ndarray      # [0] float32


class S5A8Weights(NamedTuple):
    """5-bit blocks whose minimum is -16 d (Q5_0: w = d (q - 16)), d only: 5.5 bits a weight, Q5_0's own; the tile
    forms m = -16 d (exact). Scales inside w."""
    w: np.ndarray          # [O/16, D/32, 352] uint8: pack_s5a8
    blocks: np.ndarray     # [D/32, 0] int32: one activation scale per 32 inputs
    scale: np.ndarray      # [0] float32


def s8a8_weights(wp: np.ndarray) -> S8A8Weights:
    """pack_s8a8's bytes [O/16, D/32, 544] as the symmetric byte kind."""
    return S8A8Weights(wp, act_blocks_of(wp.shape[1]), np.zeros(0, np.float32))


def q5a8_weights(wp: np.ndarray) -> Q5A8Weights:
    """pack_q5a8's bytes [O/16, D/32, 384] as the 5-bit kind."""
    return Q5A8Weights(wp, act_blocks_of(wp.shape[1]), np.zeros(0, np.float32))


def s5a8_weights(wp: np.ndarray) -> S5A8Weights:
    """pack_s5a8's bytes [O/16, D/32, 352] as the symmetric 5-bit kind."""
    return S5A8Weights(wp, act_blocks_of(wp.shape[1]), np.zeros(0, np.float32))


def b8a8_weights(wp: np.ndarray) -> B8A8Weights:
    """pack_b8a8's bytes [O/16, D/32, 576] as the byte kind."""
    return B8A8Weights(wp, act_blocks_of(wp.shape[1]), np.zeros(0, np.float32))


def q6a8_weights(wp: np.ndarray) -> Q6A8Weights:
    """pack_q6a8's bytes [O/16, D/256, 3360] as the 6-bit kind."""
    return Q6A8Weights(wp, act_blocks_of(wp.shape[1] * Q6_SUPER), np.zeros(0, np.float32))


def s4a8_weights(wp: np.ndarray) -> S4A8Weights:
    """pack_s4a8's bytes [O/16, D/32, 288] as the symmetric nibble kind."""
    return S4A8Weights(wp, act_blocks_of(wp.shape[1]), np.zeros(0, np.float32))


def w4a8_weights(wp: np.ndarray) -> W4A8Weights:
    """pack_w4a8's bytes [O/16, D/32, 320] as the W4A8 kind."""
    return W4A8Weights(wp, act_blocks_of(wp.shape[1]), np.zeros(0, np.float32))


# --- activations -------------------------------------------------------------------------------------------------

PARALLEL_ROWS = 8     # below this many rows the elementwise kernels run serially: a parallel launch costs more


def _serial_and_parallel(fn):
    """Compile an elementwise kernel twice (prange is plain range in the serial one) and pick by row count: at
    decode (T = 1..4) the work is a few microseconds, less than waking the thread pool."""
    serial, parallel = njit(cache=True)(fn), njit(cache=True, parallel=True)(fn)

    def kernel(x, *args):
        return (parallel if x.shape[0] >= PARALLEL_ROWS else serial)(x, *args)
    kernel.__doc__, kernel.__name__ = fn.__doc__, fn.__name__
    return kernel


@njit(cache=True, inline="always")
def _quantize_row(h, xu_row, sx_row):
    """One row [D] float32 -> xu_row [D] uint8 (int8 value + 128) and its scales sx_row [nb], one per block of
    D / nb inputs (nb = 1: one per row). Same arithmetic as quant.quantize_rows: s = max|h| / 127,
    q = floor(h / s + 0.5), all float32."""
    nb = sx_row.shape[0]
    kb = h.shape[0] // nb
    for b in range(nb):     # (each loop over range(kb), indexed lo + i: as range(b * kb, (b + 1) * kb) the two
        lo = b * kb         # loops do not vectorise, same bits: docs/performance.md, "A loop's bounds")
        top = np.int32(0)                    # max |h[i]| over the bits with the sign cleared: an integer max
        for i in range(kb):                  # vectorises, a float one does not (fast_exp.row_max; no NaN here)
            top = max(top, float_bits(h[lo + i]) & np.int32(0x7FFFFFFF))
        amax = bits_float(top)
        s = amax / np.float32(127.0) if amax > 0 else np.float32(1.0)
        for i in range(kb):                  # clamped as a float, then one conversion (as quant.quantize_rows:
            q = np.floor(h[lo + i] / s + np.float32(0.5))   # math.floor's int64 and an integer clamp are slower)
            xu_row[lo + i] = np.uint8(np.int32(min(max(q, np.float32(-127.0)), np.float32(127.0))) + 128)
        sx_row[b] = s


@_serial_and_parallel
def _quantize_rows(x, xu, sx):
    for t in prange(x.shape[0]):
        _quantize_row(x[t], xu[t], sx[t])


def quantize_rows(x: np.ndarray, xu: np.ndarray, sx: np.ndarray) -> None:
    """x [T, D] float32 -> xu [T, D] uint8 (offset by 128), sx [T] float32 (one scale per row) or [T, nb] (one per
    block of D / nb inputs)."""
    _quantize_rows(x, xu, sx.reshape(x.shape[0], -1))         # (a view: the kernel writes into sx)


@njit(cache=True, inline="always")
def rope_head(src, base, cos, sin, dst):
    """dst[:H] = RoPE(src[base:base + H]) for one head of one row (cos, sin: [H/2]): the same float32 operations as
    layers.apply_rope."""
    half = cos.shape[0]
    for i in range(half):
        x1, x2 = src[base + i], src[base + half + i]
        dst[i] = x1 * cos[i] - x2 * sin[i]
        dst[half + i] = x2 * cos[i] + x1 * sin[i]


@njit(cache=True, inline="always")
def split_rope_row(qkv, cos, sin, n_heads, n_kv_heads, q, k, v, t):
    """Row t of qkv [T, (N + 2K) H] (the fused projection) -> q[t] [N, H], k[t] [K, H] with RoPE applied, v[t]:
    one pass instead of ~12 NumPy calls."""
    H = q.shape[2]
    for h in range(n_heads):
        rope_head(qkv[t], h * H, cos[t], sin[t], q[t, h])
    for h in range(n_kv_heads):
        rope_head(qkv[t], (n_heads + h) * H, cos[t], sin[t], k[t, h])
    for h in range(n_kv_heads):
        for i in range(H):
            v[t, h, i] = qkv[t, (n_heads + n_kv_heads + h) * H + i]


# --- W8A8 --------------------------------------------------------------------------------------------------------

@njit(cache=True, inline="always")
def w8a8_tile(xf, sx, xsum, wf, sw, out, accumulate, D, r0, nr, b0, nc, acc):
    """One work item of the W8A8 matmul: rows r0 .. r0+nr (nr <= ROWS) x packed blocks b0 .. b0+nc (nc <= COLS).
    xf, wf: the raveled signed activations (_tile_inputs) and packed weights; sx [T, nb]: activation scales, one per
    run of D / nb inputs; xsum [T, nb]: the activations' sums over each run; acc: float32 scratch
    [ROWS * COLS * 16]."""
    nb = sx.shape[1]
    n4 = D // 4 // nb                                # 4-byte steps per activation block
    step = D // 4 * 64                               # bytes of one packed block (of 16 outputs)
    CB = COLS * BLOCK
    sf, xsf = sx.ravel(), xsum.ravel()
    # the tile: every activation block's exact integer dot products, offset undone, scaled by sx, added in float32
    if nr == ROWS and nc == COLS:
        _tile_RC(xf, r0 * D, D, wf, b0 * step, step, n4, nb, xsf, sf, r0 * nb, nb, acc, 0, CB)
    elif nc == COLS:
        for r in range(nr):
            _tile_1C(xf, (r0 + r) * D, D, wf, b0 * step, step, n4, nb, xsf, sf, (r0 + r) * nb, nb, acc, r * CB, CB)
    else:
        for r in range(nr):
            for c in range(nc):
                _tile_11(xf, (r0 + r) * D, D, wf, (b0 + c) * step, step, n4, nb, xsf, sf, (r0 + r) * nb, nb, acc,
                         r * CB + c * BLOCK, CB)
    for r in range(nr):                              # then the weights' scale
        t = r0 + r
        for j in range(nc * BLOCK):
            o = b0 * BLOCK + j
            y = acc[r * CB + j] * sw[o]
            if accumulate:
                out[t, o] += y
            else:
                out[t, o] = y


def matmul_w8a8(xu: np.ndarray, sx: np.ndarray, wp: np.ndarray, wsum: np.ndarray, sw: np.ndarray,
                out: np.ndarray | None = None, accumulate: bool = False) -> np.ndarray:
    """xu [T, D] uint8 (+128), sx [T] (one scale per row) or [T, nb] (per block of D / nb inputs), wp = pack_vnni(wq),
    wsum [O] or [nb, O] int32 = the sums of wq over each block's inputs (block_sums), sw [O] -> [T, O] float32.
    With accumulate=True the result is added to `out` (the residual connection, without a temporary). (The tiles
    here put the + 128 on the weights and read only wsum's shape: int8_dot.py says why.)"""
    if out is None:
        out = np.empty((xu.shape[0], wp.shape[0] * BLOCK), np.float32)
    sx, wsum = sx.reshape(xu.shape[0], -1), wsum.reshape(-1, wp.shape[0] * BLOCK)
    if sx.shape[1] != wsum.shape[0]:
        raise ValueError(f"sx has {sx.shape[1]} scales per row but wsum sums {wsum.shape[0]} blocks")
    _matmul_int8(W8A8Weights(wp, act_blocks_of(wsum.shape[0]), sw), xu, sx, out, accumulate)
    return out


# --- W8A32 -------------------------------------------------------------------------------------------------------

@njit(cache=True, inline="always")
def _scale_tile(acc, nr, nc, r0, b0, sw, out, accumulate):
    """The W8A32 epilogue: out[r0 + r, 16 b0 + j] = (or +=) acc[r, j] * sw[16 b0 + j] for a tile's nr x 16 nc."""
    for r in range(nr):
        for j in range(nc * BLOCK):
            o = b0 * BLOCK + j
            y = acc[r * COLS * BLOCK + j] * sw[o]
            if accumulate:
                out[r0 + r, o] += y
            else:
                out[r0 + r, o] = y


@njit(cache=True, inline="always")
def w8a32_tile(xf, wf, sw, out, accumulate, D, r0, nr, b0, nc, acc):
    """One work item of the W8A32 matmul (few rows): rows r0 .. r0+nr x packed blocks b0 .. b0+nc; acc: float32
    scratch [ROWS * COLS * 16]."""
    step = D * BLOCK                                 # bytes of one packed block
    if nr == ROWS and nc == COLS:
        _ftile_RC(xf, r0 * D, D, wf, b0 * step, step, D, BLOCK, acc, 0, COLS * BLOCK)
    elif nc == COLS:
        for r in range(nr):
            _ftile_1C(xf, (r0 + r) * D, D, wf, b0 * step, step, D, BLOCK, acc, r * COLS * BLOCK, COLS * BLOCK)
    else:
        for r in range(nr):
            for c in range(nc):
                _ftile_11(xf, (r0 + r) * D, D, wf, (b0 + c) * step, step, D, BLOCK, acc, r * COLS * BLOCK + c * BLOCK,
                          COLS * BLOCK)
    _scale_tile(acc, nr, nc, r0, b0, sw, out, accumulate)


# At prefill the kernel above is compute-bound, and a third of its vector instructions are not multiply-adds: every
# tile widens its 4 weight vectors (int8 -> int32 -> float32, two instructions each) for only 4 rows. Here a work
# item (a group of COLS blocks, a chunk of WIDE_CHUNK rows) widens its weights once into a float32 scratch that
# stays in L2 (D x 64 x 4 bytes), then sweeps its rows with the plain float tile, 6 rows per
# weight load. Each output still sums x[t, i] * w[i] for i = 0, 1, ... with one fma per step, so the result is
# bit-identical to _matmul_w8a32's; only the instruction mix changes. It reaches the speed of OpenBLAS's float32
# sgemm on the same shape, the CPU's fp32 FMA peak (docs/performance.md, "Why the kernels' constants are what they
# are"). That is also why W8A32 prefill cannot beat PyTorch's float32 by much (same multiply-adds on the same
# units); W8A8's integer dot products (4 multiply-adds per lane per instruction) can.

@njit(cache=True, inline="always")
def matmul_w8a32_wide(x, wp, sw, out, accumulate):
    """The W8A32 matmul's parallel loop for many rows (prefill), weights widened once per work item."""
    T, D = x.shape
    n_blocks = wp.shape[0]
    row_chunks = (T + WIDE_CHUNK - 1) // WIDE_CHUNK
    col_groups = (n_blocks + COLS - 1) // COLS
    xf = x.ravel()
    for item in prange(row_chunks * col_groups):
        g, rc = item // row_chunks, item % row_chunks
        b0, c0 = g * COLS, rc * WIDE_CHUNK
        nc, n_rows = min(COLS, n_blocks - b0), min(WIDE_CHUNK, T - c0)
        wf = wp[b0:b0 + nc].astype(np.float32).ravel()          # [nc, D, 16] widened once (exact: small integers)
        step = D * BLOCK
        acc = np.empty(WIDE_ROWS * COLS * BLOCK, np.float32)
        for r0 in range(c0, c0 + n_rows, WIDE_ROWS):
            nr = min(WIDE_ROWS, c0 + n_rows - r0)
            if nr == WIDE_ROWS and nc == COLS:
                _wide_RC(xf, r0 * D, D, wf, 0, step, D, BLOCK, acc, 0, COLS * BLOCK)
            elif nc == COLS:
                for r in range(nr):
                    _wide_1C(xf, (r0 + r) * D, D, wf, 0, step, D, BLOCK, acc, r * COLS * BLOCK, COLS * BLOCK)
            else:
                for r in range(nr):
                    for c in range(nc):
                        _wide_11(xf, (r0 + r) * D, D, wf, c * step, step, D, BLOCK, acc,
                                 r * COLS * BLOCK + c * BLOCK, COLS * BLOCK)
            _scale_tile(acc, nr, nc, r0, b0, sw, out, accumulate)


@njit(cache=True, inline="always")
def matmul_w8a32_body(wt, x, out, accumulate):
    """The W8A32 matmul: the wide loop from WIDE_MIN_ROWS rows on, the tiled one (matmul_items) below (the same
    result)."""
    if x.shape[0] >= WIDE_MIN_ROWS:
        matmul_w8a32_wide(x, wt.w, wt.scale, out, accumulate)
    else:
        matmul_items(wt, x, None, out, accumulate)


@njit(cache=True, parallel=True)
def _matmul_w8a32(x, wp, sw, out, accumulate):
    """The tiled loop whatever the row count (tests compare it with the wide one)."""
    matmul_items(W8A32Weights(wp, np.zeros((1, 0), np.int32), sw), x, None, out, accumulate)


@njit(cache=True, parallel=True)
def _matmul_w8a32_auto(wt, x, out, accumulate):
    """The wide or the tiled loop by row count: what matmul_w8a32 and the fused layer kernels (layer.py) call."""
    matmul_w8a32_body(wt, x, out, accumulate)


@njit(cache=True, parallel=True)
def _matmul_w8a32_wide(x, wp, sw, out, accumulate):
    matmul_w8a32_wide(x, wp, sw, out, accumulate)


def matmul_w8a32(x: np.ndarray, wp: np.ndarray, sw: np.ndarray, out: np.ndarray | None = None,
                 accumulate: bool = False) -> np.ndarray:
    """x [T, D] float32, wp = pack_w8a32(wq), sw [O] -> [T, O] float32 (added to `out` if accumulate)."""
    if out is None:
        out = np.empty((x.shape[0], wp.shape[0] * BLOCK), np.float32)
    _matmul_w8a32_auto(W8A32Weights(wp, act_blocks_of(1), sw), x, out, accumulate)
    return out


# --- W4A8 --------------------------------------------------------------------------------------------------------
# 4-bit weights as the GGUF ships them (Q4_1: w = d * q + m per run of 32 inputs), int8 activations per run of 32:
# the tile is kernels/int4_dot.py's; the rest mirrors W8A8 above.

# the prefill of 5- and 6-bit matrices (_as_bytes) runs their values unpacked to whole bytes through the byte tile:
# Q5_1's and Q5_K's as they are, Q5_0's (d only: pack_s8a8's layout) with m = -16 d, the 5-bit tile's arithmetic
# (values 0..31: max_q tells avx2's byte tile it need not split them into nibbles); Q6_K's with the 6-bit tile's
_b8_RC = make_w4a8_tile(ROWS, COLS, whole_bytes=True, max_q=31)
_b5_RC = make_w4a8_tile(ROWS, COLS, whole_bytes=True, symmetric=True, min_per_d=FIVE_MIN_PER_D, max_q=31)
_q6b_RC = make_w4a8_tile(ROWS, COLS, whole_bytes=True, six_bits=True)


def _block_steps(q: np.ndarray, d: np.ndarray, m: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """q [D, O] uint8, d and m [D/32, O] -> (the 8 4-input steps of pack_vnni's layout per block of 16 outputs and
    run of 32 inputs [O/16, D/32, 8, 64] uint8, d[16] and m[16] as float16 bytes [O/16, D/32, 64])."""
    D, O = q.shape
    if D % GROUP or O % BLOCK:
        raise ValueError(f"{kind} needs D % {GROUP} == 0 and O % {BLOCK} == 0, got a [{D}, {O}] matrix")
    steps = pack_vnni(q.view(np.int8)).view(np.uint8).reshape(O // BLOCK, D // GROUP, GROUP // 4, 4 * BLOCK)
    half = lambda a: np.ascontiguousarray(                                       # noqa: E731
        a.astype(np.float16).reshape(D // GROUP, O // BLOCK, BLOCK).transpose(1, 0, 2)).view(np.uint8)
    return steps, np.concatenate([half(d), half(m)], axis=2)


def pack_w4a8(q: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    """q [D, O] uint8 (0..15), d and m [D/32, O] (float16 values) -> [O/16, D/32, 320] uint8: per block of 16
    outputs and run of 32 inputs, d[16] and m[16] as float16, then the 8 4-input steps of pack_vnni's layout two to
    a byte (step 2j in the low nibble, 2j + 1 in the high one)."""
    steps, scales = _block_steps(np.asarray(q, np.uint8), d, m, "pack_w4a8")
    nibbles = steps[:, :, 0::2] | (steps[:, :, 1::2] << 4)                      # [O/16, D/32, 4, 64]
    return np.ascontiguousarray(np.concatenate([scales, nibbles.reshape(*scales.shape[:2], -1)], axis=2))


def pack_s4a8(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """q [D, O] uint8 (0..15), d [D/32, O] (float16 values) of blocks whose minimum is -8 d (Q4_0) -> [O/16, D/32,
    288] uint8: pack_w4a8's layout without m (the symmetric tile forms it from d: int4_dot.MIN_PER_D)."""
    steps, scales = _block_steps(np.asarray(q, np.uint8), d, d, "pack_s4a8")
    nibbles = steps[:, :, 0::2] | (steps[:, :, 1::2] << 4)                      # [O/16, D/32, 4, 64]
    return np.ascontiguousarray(np.concatenate([scales[:, :, :2 * BLOCK], nibbles.reshape(*scales.shape[:2], -1)],
                                               axis=2))


def pack_q6a8(q: np.ndarray, sc: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Q6_K's blocks: q [D, O] uint8 (0..63, the offset 32 not taken off), sc [D/16, O] int8, d [D/256, O] (float16
    values) -> [O/16, D/256, 3360] uint8: per block of 16 outputs and super-block of 256 inputs, d[16] as float16,
    then per block of 32 inputs (int4_dot.Q6_GROUP_BYTES): sc[2][16], the low nibbles as pack_w4a8's, the top 2 bits
    (steps 4v .. 4v + 3 in the 4 bit pairs of vector v's bytes)."""
    q = np.asarray(q, np.uint8)
    D, O = q.shape
    if D % (GROUP * Q6_SUPER) or O % BLOCK:
        raise ValueError(f"pack_q6a8 needs D % 256 == 0 and O % {BLOCK} == 0, got a [{D}, {O}] matrix")
    nb, nc = D // GROUP, O // BLOCK
    steps = pack_vnni(q.view(np.int8)).view(np.uint8).reshape(nc, nb, GROUP // 4, 4 * BLOCK)   # [c, b, 8, 64]
    nibbles = (steps[:, :, 0::2] & 15) | ((steps[:, :, 1::2] & 15) << 4)                     # [c, b, 4, 64]
    top = steps >> 4                                                                        # 0..3
    crumbs = top[:, :, 0::4] | (top[:, :, 1::4] << 2) | (top[:, :, 2::4] << 4) | (top[:, :, 3::4] << 6)  # [c, b, 2, 64]
    scb = np.asarray(sc, np.int8).reshape(nb, 2, nc, BLOCK).transpose(2, 0, 1, 3).view(np.uint8)        # [c, b, 2, 16]
    groups = np.concatenate([scb.reshape(nc, nb, -1), nibbles.reshape(nc, nb, -1), crumbs.reshape(nc, nb, -1)],
                            axis=2).reshape(nc, nb // Q6_SUPER, -1)                        # [c, D/256, 8 * 416]
    dh = np.ascontiguousarray(np.asarray(d, np.float32).astype(np.float16).reshape(-1, nc, BLOCK).transpose(1, 0, 2))
    return np.ascontiguousarray(np.concatenate([dh.view(np.uint8), groups], axis=2))


def pack_b8a8(q: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    """q [D, O] uint8 (0..255), d and m [D/32, O] (float16 values) -> [O/16, D/32, 576] uint8: pack_w4a8's layout
    with each step's 64 bytes whole (the byte tile: int4_dot.make_w4a8_tile(whole_bytes=True))."""
    steps, scales = _block_steps(np.asarray(q, np.uint8), d, m, "pack_b8a8")
    return np.ascontiguousarray(np.concatenate([scales, steps.reshape(*scales.shape[:2], -1)], axis=2))


def pack_s8a8(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """q [D, O] uint8 (0..255), d [D/32, O] (float16 values) of blocks whose minimum is -128 d (Q8_0's q + 128) ->
    [O/16, D/32, 544] uint8: pack_b8a8's layout without m (the tile forms it: int4_dot.BYTE_MIN_PER_D)."""
    steps, scales = _block_steps(np.asarray(q, np.uint8), d, d, "pack_s8a8")
    return np.ascontiguousarray(np.concatenate([scales[:, :, :2 * BLOCK], steps.reshape(*scales.shape[:2], -1)],
                                               axis=2))


def _five_bit_steps(q: np.ndarray, d: np.ndarray, m: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """q [D, O] uint8 (0..31) -> (pack_w4a8's nibbles of q & 15, then the fifth bits: bit s of byte 4l + k is step
    s's bit 4 [O/16, D/32, 320] uint8; d[16] and m[16] as float16 bytes [O/16, D/32, 64])."""
    q = np.asarray(q, np.uint8)
    if q.size and q.max() > 31:
        raise ValueError(f"{kind} takes 5-bit values (0..31), got {int(q.max())}")
    steps, scales = _block_steps(q, d, m, kind)                                   # [O/16, D/32, 8, 64]
    nibbles = (steps[:, :, 0::2] & 15) | ((steps[:, :, 1::2] & 15) << 4)           # [O/16, D/32, 4, 64]
    fifth = ((steps >> 4) << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=2, dtype=np.uint8)   # [.., 64]
    assert fifth.shape[-1] == FIVE_BITS_BYTES
    return np.concatenate([nibbles.reshape(*scales.shape[:2], -1), fifth], axis=2), scales


def pack_q5a8(q: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    """q [D, O] uint8 (0..31), d and m [D/32, O] (float16 values) -> [O/16, D/32, 384] uint8: d[16] and m[16] as
    float16, the low nibbles as pack_w4a8's, then the 8 steps' fifth bits (the 5-bit tile:
    int4_dot.make_w4a8_tile(five_bits=True))."""
    bits, scales = _five_bit_steps(q, d, m, "pack_q5a8")
    return np.ascontiguousarray(np.concatenate([scales, bits], axis=2))


def pack_s5a8(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """q [D, O] uint8 (0..31), d [D/32, O] of blocks whose minimum is -16 d (Q5_0) -> [O/16, D/32, 352] uint8:
    pack_q5a8's layout without m (the tile forms it: int4_dot.FIVE_MIN_PER_D)."""
    bits, scales = _five_bit_steps(q, d, d, "pack_s5a8")
    return np.ascontiguousarray(np.concatenate([scales[:, :, :2 * BLOCK], bits], axis=2))


@njit(cache=True, inline="always")
def _store_tile(acc, out, accumulate, r0, nr, b0, nc):
    """A W4A8 or byte tile's float32 results (acc [ROWS * COLS * 16]) into out's rows r0.. and blocks b0.. (or added)."""
    CB = COLS * BLOCK
    for r in range(nr):
        for j in range(nc * BLOCK):
            o = b0 * BLOCK + j
            if accumulate:
                out[r0 + r, o] += acc[r * CB + j]
            else:
                out[r0 + r, o] = acc[r * CB + j]


def forms_weights_once_for_two_rows(tile_kind: dict) -> bool:
    """Whether a kind's tile (int4_dot.make_w4a8_tile's flags) is the 5-bit one, which forms each weight vector in
    registers in about a dozen instructions and then multiplies it in two per row: its sub-tiles hold two rows on avx2
    (int4_dot._plan's rows_first), so its short row tiles run two rows at a time (make_tile_driver's pair) and a
    second row costs less than the first (pairs_share_weights). The other kinds' short tiles run one row at a time."""
    return bool(tile_kind.get("five_bits"))


def make_tile_driver(unit_bytes: int, unit_groups: int = 1, **tile_kind):
    """The work item of one packed kind: rows r0 .. r0+nr (nr <= ROWS) x packed blocks b0 .. b0+nc (nc <= COLS), run
    by the kind's tiles (int4_dot.make_w4a8_tile(R, C, **tile_kind)) at the three shapes an item can have: whole,
    one row of COLS blocks, one block. A packed block (of 16 outputs) takes unit_bytes per unit_groups groups of 32
    inputs (Q6_K: a super-block of 8 groups). The function returned is
    tile(xf, sx, xs, wf, out, accumulate, D, r0, nr, b0, nc, acc): xf the signed activation bytes (_tile_inputs),
    sx, xs [T, D/32] (Q6_K's xs [T, D/16]), wf the raveled packed weights, acc float32 scratch [ROWS * COLS * 16]."""
    full, row, one = (make_w4a8_tile(ROWS, COLS, **tile_kind), make_w4a8_tile(1, COLS, **tile_kind),
                      make_w4a8_tile(1, 1, **tile_kind))
    two_rows = forms_weights_once_for_two_rows(tile_kind)
    pair, per_pair = (make_w4a8_tile(2, COLS, **tile_kind), 2) if two_rows else (row, 1)

    # inlined into its callers, which Numba caches; called from Python on its own it would compile again in every
    # process (Numba's cache key hashes a closure's values, and a tile's pickle differs from process to process)
    @njit(cache=True, inline="always")
    def tile(xf, sx, xs, wf, out, accumulate, D, r0, nr, b0, nc, acc):
        nb = D // GROUP
        step = nb // unit_groups * unit_bytes        # bytes of one packed block (of 16 outputs)
        CB = COLS * BLOCK
        sf, xsf = sx.ravel(), xs.ravel()
        if nr == ROWS and nc == COLS:
            full(xf, r0 * D, D, wf, b0 * step, step, nb, sf, xsf, r0 * nb, nb, acc, 0, CB)
        elif nc == COLS:
            paired = nr // per_pair * per_pair
            for r in range(0, paired, per_pair):
                pair(xf, (r0 + r) * D, D, wf, b0 * step, step, nb, sf, xsf, (r0 + r) * nb, nb, acc, r * CB, CB)
            for r in range(paired, nr):
                row(xf, (r0 + r) * D, D, wf, b0 * step, step, nb, sf, xsf, (r0 + r) * nb, nb, acc, r * CB, CB)
        else:
            for r in range(nr):
                for c in range(nc):
                    one(xf, (r0 + r) * D, D, wf, (b0 + c) * step, step, nb, sf, xsf, (r0 + r) * nb, nb, acc,
                        r * CB + c * BLOCK, CB)
        _store_tile(acc, out, accumulate, r0, nr, b0, nc)
    return tile


# the kinds whose scales travel inside w: each one's bytes per group of 32 inputs (Q6_K: per super-block of 8) and
# its tile's flags; one driver each (make_tile_driver), all called alike
TILE_KINDS = {W4A8Weights: (GROUP_BYTES, 1, {}),                                                        # Q4_1
              S4A8Weights: (SYM_GROUP_BYTES, 1, {"symmetric": True}),                                  # Q4_0
              Q6A8Weights: (Q6_SUPER_BYTES, Q6_SUPER, {"six_bits": True}),                             # Q6_K
              B8A8Weights: (BYTE_GROUP_BYTES, 1, {"whole_bytes": True}),
              S8A8Weights: (SYM_BYTE_GROUP_BYTES, 1, {"whole_bytes": True, "symmetric": True}),        # Q8_0
              Q5A8Weights: (Q5_GROUP_BYTES, 1, {"five_bits": True}),                                   # Q5_1, Q5_K
              S5A8Weights: (SYM_Q5_GROUP_BYTES, 1, {"five_bits": True, "symmetric": True})}            # Q5_0
GROUP_TILES = {kind: make_tile_driver(unit_bytes, unit_groups, **flags)
               for kind, (unit_bytes, unit_groups, flags) in TILE_KINDS.items()}


def matmul_w4a8(xu: np.ndarray, sx: np.ndarray, wp: np.ndarray, out: np.ndarray | None = None,
                accumulate: bool = False) -> np.ndarray:
    """xu [T, D] uint8 (+128), sx [T, D/32] (one scale per block of 32 inputs), wp = pack_w4a8(q, d, m) -> [T, O];
    or wp = pack_b8a8(q, d, m) (its last axis 576 bytes, not 320): the byte tile; or pack_s4a8(q, d) (288): the
    symmetric nibble tile; or pack_q6a8(q, sc, d) (3360 per 256 inputs): the 6-bit tile; or pack_s8a8 (544), pack_q5a8
    (384), pack_s5a8 (352): the byte tile without m, the 5-bit tile, and it without m."""
    T, D = xu.shape
    if out is None:
        out = np.empty((T, wp.shape[0] * BLOCK), np.float32)
    sx = np.ascontiguousarray(sx, np.float32).reshape(T, D // GROUP)
    kinds = {BYTE_GROUP_BYTES: b8a8_weights, SYM_GROUP_BYTES: s4a8_weights, GROUP_BYTES: w4a8_weights,
             Q6_SUPER_BYTES: q6a8_weights, SYM_BYTE_GROUP_BYTES: s8a8_weights, Q5_GROUP_BYTES: q5a8_weights,
             SYM_Q5_GROUP_BYTES: s5a8_weights}
    wt = kinds[wp.shape[-1]](wp)
    _matmul_int8(wt, xu, sx, out, accumulate)
    return out


# --- one work split for every kind -------------------------------------------------------------------------------
# Every matmul here is the same walk over work items of (a tile of up to ROWS rows, a group of up to COLS packed
# blocks), whatever the kind: the kind only decides which tile runs an item and what it reads. Two drivers walk
# them: matmul_items, every item of a matrix in a parallel loop (the three-call layers and the public matmuls), and
# matmul_blocks, the items of output blocks b_lo .. b_hi on the calling thread (a thread of the fused decode step,
# which gets its blocks from thread_share). The drivers are written once; the kinds' differences are the three
# overloads below, chosen by the weights' class when Numba compiles the caller.

@njit(cache=True, inline="always")
def thread_share(n, tid, n_threads):
    """Thread tid's part [lo, hi) of n work units (a matrix's output blocks, a step's attention heads) split evenly
    over n_threads in order: neighbours get neighbouring units, so each output column has one writer."""
    return n * tid // n_threads, n * (tid + 1) // n_threads


@njit(cache=True, inline="always")
def weighted_share(n, lo, hi, cost_out, cost_in, tid, n_threads):
    """thread_share of n units in order where units lo .. hi each cost cost_in and the others cost_out (integers):
    each thread's cost as even as whole units allow (a gate|up matmul whose up half also multiplies the input's
    second plane: block_decode._residual_then_matmul). Without such units (the LM head's call) it is thread_share's
    split, found without walking the units."""
    if lo >= hi or cost_in == cost_out:
        return thread_share(n, tid, n_threads)
    return (_weighted_start(n, lo, hi, cost_out, cost_in, tid, n_threads),
            _weighted_start(n, lo, hi, cost_out, cost_in, tid + 1, n_threads))


@njit(cache=True, inline="always")
def _weighted_start(n, lo, hi, cost_out, cost_in, k, n_threads):
    """The last unit whose cost before it is at most k / n_threads of the total (equal costs: n k // n_threads)."""
    total = cost_out * n + (cost_in - cost_out) * (hi - lo)
    u = 0
    while u < n and (cost_out * (u + 1) + (cost_in - cost_out) * min(max(u + 1 - lo, 0), hi - lo)) * n_threads \
            <= total * k:
        u += 1
    return u


def _input(wt, x, xu):
    """The rows the kind multiplies: x (float32, W8A32) or xu (uint8 + 128, the int8-activation kinds)."""
    raise NotImplementedError("called from Numba-compiled code only")


def _tile_inputs(wt, xu, sx):
    """What the kind's tile reads besides the weights: (its activations, xs). The int8-activation kinds: the
    activations as signed bytes (uint8 + 128 with the sign bits flipped back: the tiles broadcast them straight from
    memory) and xs [T, nb], each row's int8 values summed over each block: W8A8 as int32 (the term the weights'
    + 128 adds, int8_dot.py), W4A8 times the block's scale (the term Q4_1's minimum multiplies, int4_dot.py), the
    byte kinds (B8A8, S8A8) as int32 again (avx2's byte tile adds 128 times them back: int4_dot._sign_step; the tile
    multiplies them by sx itself). W8A32: x as it is, and sx back (unread)."""
    raise NotImplementedError("called from Numba-compiled code only")


def _tile(wt, wf, xf, sx, xs, out, accumulate, D, r0, nr, b0, nc, acc):
    """One work item of the kind's matmul: rows r0 .. r0+nr x packed blocks b0 .. b0+nc, into out (or added)."""
    raise NotImplementedError("called from Numba-compiled code only")


def _layer(wt, i):
    """Layer i of a matrix stacked over the layers (every array [L, ...]), as the same kind."""
    raise NotImplementedError("called from Numba-compiled code only")


KINDS = (W8A8Weights, W8A32Weights, W4A8Weights, S4A8Weights, Q6A8Weights, B8A8Weights, S8A8Weights, Q5A8Weights,
         S5A8Weights)


def _kind(wt):
    kind = getattr(wt, "instance_class", None)
    if kind not in KINDS:
        raise TypeError(f"the matmuls take {', '.join(k.__name__ for k in KINDS[:-1])} or {KINDS[-1].__name__}, "
                        f"not {wt}")
    return kind


@overload(_layer, inline="always")
def _layer_of_kind(wt, i):
    kind = _kind(wt)
    return lambda wt, i: kind(wt.w[i], wt.blocks[i], wt.scale[i])


@overload(_input, inline="always")
def _input_of_kind(wt, x, xu):
    if _kind(wt) is W8A32Weights:
        return lambda wt, x, xu: x
    return lambda wt, x, xu: xu


@njit(cache=True, inline="always")
def signed_and_sums(xu, nb):
    """xu [T, D] uint8 (+ 128) -> (the int8 values' bits in uint8 storage: xu ^ 0x80 = xu - 128; their sums over
    each of nb blocks of a row, int32 [T, nb])."""
    T, D = xu.shape
    kb = D // nb
    xi = np.empty_like(xu)
    sums = np.empty((T, nb), np.int32)
    for t in prange(T):                              # (parallel in matmul_items, serial in a decode-step thread)
        for b in range(nb):
            lo, s = b * kb, np.int32(0)
            for i in range(kb):                      # (indexed lo + i, as in _quantize_row)
                s += np.int32(xu[t, lo + i]) - 128
                xi[t, lo + i] = xu[t, lo + i] ^ np.uint8(0x80)
            sums[t, b] = s
    return xi, sums


@overload(_tile_inputs, inline="always")
def _tile_inputs_of_kind(wt, xu, sx):
    kind = _kind(wt)
    if kind is W8A32Weights:
        return lambda wt, xu, sx: (xu, sx)
    if kind is W8A8Weights or kind is B8A8Weights or kind is S8A8Weights:   # (the byte tile: int4_dot._sign_step)
        return lambda wt, xu, sx: signed_and_sums(xu, sx.shape[1])
    if kind is Q6A8Weights:                          # the integer sums per 16 (the halves Q6_K's scales cover)
        return lambda wt, xu, sx: signed_and_sums(xu, 2 * sx.shape[1])

    def scaled_sums(wt, xu, sx):
        xi, sums = signed_and_sums(xu, sx.shape[1])
        return xi, sx * sums.astype(np.float32)
    return scaled_sums


@overload(_tile, inline="always")
def _tile_of_kind(wt, wf, xf, sx, xs, out, accumulate, D, r0, nr, b0, nc, acc):
    kind = _kind(wt)
    if kind is W8A8Weights:
        def tile(wt, wf, xf, sx, xs, out, accumulate, D, r0, nr, b0, nc, acc):
            w8a8_tile(xf, sx, xs, wf, wt.scale, out, accumulate, D, r0, nr, b0, nc, acc)
    elif kind is W8A32Weights:
        def tile(wt, wf, xf, sx, xs, out, accumulate, D, r0, nr, b0, nc, acc):
            w8a32_tile(xf, wf, wt.scale, out, accumulate, D, r0, nr, b0, nc, acc)
    else:
        driver = GROUP_TILES[kind]

        def tile(wt, wf, xf, sx, xs, out, accumulate, D, r0, nr, b0, nc, acc):
            driver(xf, sx, xs, wf, out, accumulate, D, r0, nr, b0, nc, acc)
    return tile


@njit(cache=True, inline="always")
def matmul_items(wt, x, sx, out, accumulate):
    """out [T, O] (+)= x [T, D] @ wt, every work item in a parallel loop. x: float32 for W8A32 (sx: None), else
    uint8 + 128 with its scales sx [T, nb]."""
    T, D = x.shape
    n_blocks = wt.w.shape[0]
    row_tiles = (T + ROWS - 1) // ROWS
    col_groups = (n_blocks + COLS - 1) // COLS
    xt, xs = _tile_inputs(wt, x, sx)
    xf, wf = xt.ravel(), wt.w.ravel()
    # items run column-group-major: a thread walks all row tiles of one weight group while it is in cache
    for item in prange(row_tiles * col_groups):
        g, rt = item // row_tiles, item % row_tiles
        r0, b0 = rt * ROWS, g * COLS
        acc = np.empty(ROWS * COLS * BLOCK, np.float32)  # [nr, nc*16] row-major, row stride COLS*16
        _tile(wt, wf, xf, sx, xs, out, accumulate, D, r0, min(ROWS, T - r0), b0, min(COLS, n_blocks - b0), acc)


@njit(cache=True)
def matmul_blocks(wt, x, xu, sx, out, accumulate, b_lo, b_hi, acc):
    """The matmul restricted to output blocks b_lo .. b_hi (every row), on the calling thread: one thread's share of
    a matmul in kernels/decode_step.py, which has both forms of its rows at hand (x float32, xu + sx quantised; the
    kind reads its own). acc: float32 scratch [ROWS * COLS * 16]. A function call, not inlined: the decode step has
    5 matmuls per mode, and inlining the tiles into each would multiply its first compile's time. From UNPACK_ROWS
    rows on, a 5- or 6-bit kind's whole column groups are unpacked to bytes once each (_groups_as_bytes)."""
    a = _input(wt, x, xu)
    T, D = a.shape
    at, xs = _tile_inputs(wt, a, sx)
    af, wf = at.ravel(), wt.w.ravel()
    b_from = _groups_as_bytes(wt, af, wf, sx, xs, out, accumulate, T, D, b_lo, b_hi, acc)  # 5-, 6-bit kinds
    for b0 in range(b_from, b_hi, COLS):
        for r0 in range(0, T, ROWS):
            _tile(wt, wf, af, sx, xs, out, accumulate, D, r0, min(ROWS, T - r0), b0, min(COLS, b_hi - b0), acc)


# --- a prefill of 5- and 6-bit weights: unpacked once per column group --------------------------------------------
# The 5-bit tile forms q = nibble | fifth bit << 4 in registers for every row tile it runs (the 6-bit tile, q =
# nibble | top two bits << 4): free at batch 1, where the weights' bytes set the pace, but a prefill is
# compute-bound and runs T / ROWS row tiles over each weight. From UNPACK_ROWS rows on, each thread unpacks its
# column groups to whole bytes once (pack_b8a8's layout, pack_s8a8's for Q5_0, Q6B_SUPER_BYTES' for Q6_K) and runs
# the byte tile over every row tile: the same integers, d and m (Q6_K: sc and d), and the same float32 operations in
# the same order (m = -16 d formed as the 5-bit tile forms it), so the same bits.
UNPACK_ROWS = 4 * ROWS


@njit(cache=True)
def five_bits_to_bytes(w, b0, nc, with_m, scratch):
    """Output blocks b0 .. b0 + nc - 1 of a 5-bit pack (w [O/16, nb, 384]: pack_q5a8, with_m; [O/16, nb, 352]:
    pack_s5a8) -> scratch [nc, nb, 576 | 544] uint8 in pack_b8a8's (pack_s8a8's) layout: the scales as they are,
    then step s's 64 bytes, q = its nibble (pair s // 2, the high one for odd s) | its fifth bit (bit s) << 4."""
    sb = 2 * 2 * BLOCK if with_m else 2 * BLOCK
    for c in range(nc):
        for b in range(w.shape[1]):
            src, dst = w[b0 + c, b], scratch[c, b]
            dst[:sb] = src[:sb]
            for s in range(GROUP // 4):
                nib, shift = sb + (s // 2) * 64, 4 * (s % 2)
                for p in range(64):
                    dst[sb + 64 * s + p] = ((src[nib + p] >> shift) & 15) | (((src[sb + 256 + p] >> s) & 1) << 4)


@njit(cache=True)
def six_bits_to_bytes(w, b0, nc, scratch):
    """Output blocks b0 .. b0 + nc - 1 of a Q6_K pack (w [O/16, D/256, 3360]: pack_q6a8) -> scratch [nc, D/256,
    Q6B_SUPER_BYTES] uint8: d[16] and each block's sc as they are, then step s's 64 bytes, q = its nibble (pair
    s // 2, the high one for odd s) | its top two bits (vector s // 4, bits 2 (s % 4)) << 4."""
    for c in range(nc):
        for u in range(w.shape[1]):
            src, dst = w[b0 + c, u], scratch[c, u]
            dst[:2 * BLOCK] = src[:2 * BLOCK]
            for g in range(Q6_SUPER):
                s0, d0 = 2 * BLOCK + g * Q6_GROUP_BYTES, 2 * BLOCK + g * Q6B_GROUP_BYTES
                dst[d0:d0 + Q6_SC_BYTES] = src[s0:s0 + Q6_SC_BYTES]
                nib, top = s0 + Q6_SC_BYTES, s0 + Q6_SC_BYTES + GROUP * BLOCK // 2
                for s in range(GROUP // 4):
                    n_at, n_shift = nib + (s // 2) * 64, 4 * (s % 2)
                    t_at, t_shift = top + (s // 4) * 64, 2 * (s % 4)
                    for p in range(64):
                        dst[d0 + Q6_SC_BYTES + 64 * s + p] = (((src[n_at + p] >> n_shift) & 15)
                                                              | (((src[t_at + p] >> t_shift) & 3) << 4))


def _unpacked_bytes(wt):
    pass


@overload(_unpacked_bytes, inline="always")
def _unpacked_bytes_of_kind(wt):
    """Bytes of one packed block (16 outputs, every input) unpacked to whole bytes."""
    kind = _kind(wt)
    if kind is Q6A8Weights:
        return lambda wt: wt.w.shape[1] * Q6B_SUPER_BYTES
    gb = BYTE_GROUP_BYTES if kind is Q5A8Weights else SYM_BYTE_GROUP_BYTES
    return lambda wt: wt.w.shape[1] * gb


def _unpack(wt, b0, scratch):
    pass


@overload(_unpack, inline="always")
def _unpack_of_kind(wt, b0, scratch):
    """Output blocks b0 .. b0 + COLS - 1 of wt unpacked into scratch (flat: COLS x _unpacked_bytes)."""
    kind = _kind(wt)
    if kind is Q6A8Weights:
        return lambda wt, b0, scratch: six_bits_to_bytes(
            wt.w, b0, COLS, scratch.reshape((COLS, wt.w.shape[1], Q6B_SUPER_BYTES)))
    with_m, gb = kind is Q5A8Weights, BYTE_GROUP_BYTES if kind is Q5A8Weights else SYM_BYTE_GROUP_BYTES
    return lambda wt, b0, scratch: five_bits_to_bytes(wt.w, b0, COLS, with_m,
                                                      scratch.reshape((COLS, wt.w.shape[1], gb)))


def _bytes_tile(wt, xf, x_off, D, bf, step, nb, sf, xsf, s_off, acc):
    pass


@overload(_bytes_tile, inline="always")
def _bytes_tile_of_kind(wt, xf, x_off, D, bf, step, nb, sf, xsf, s_off, acc):
    """The ROWS x COLS byte tile of wt's kind over unpacked blocks (block c at c * step of bf)."""
    tile = {Q5A8Weights: _b8_RC, S5A8Weights: _b5_RC, Q6A8Weights: _q6b_RC}[_kind(wt)]
    return lambda wt, xf, x_off, D, bf, step, nb, sf, xsf, s_off, acc: tile(
        xf, x_off, D, bf, 0, step, nb, sf, xsf, s_off, nb, acc, 0, COLS * BLOCK)


@njit(cache=True, inline="always")
def _group_on_bytes(wt, b0, scratch, xf, wf, sx, xs, sf, xsf, out, accumulate, T, D, acc):
    """Output blocks b0 .. b0 + COLS - 1 of a 5- or 6-bit kind, every row: the group unpacked to whole bytes once
    (_unpack, into scratch) and run through the byte tile over every whole row tile; the last rows (T not a multiple
    of ROWS) on the kind's own tile. xf, sf, xsf: the rows' tile inputs and their scales and sums, flat."""
    nb, step = D // GROUP, _unpacked_bytes(wt)
    row_tiles = T // ROWS
    _unpack(wt, b0, scratch)
    for rt in range(row_tiles):
        r0 = rt * ROWS
        _bytes_tile(wt, xf, r0 * D, D, scratch, step, nb, sf, xsf, r0 * nb, acc)
        _store_tile(acc, out, accumulate, r0, ROWS, b0, COLS)
    if T > row_tiles * ROWS:
        _tile(wt, wf, xf, sx, xs, out, accumulate, D, row_tiles * ROWS, T - row_tiles * ROWS, b0, COLS, acc)


@njit(cache=True, parallel=True)
def _as_bytes(wt, xu, sx, out, accumulate):
    """matmul_items for 5- and 6-bit kinds at many rows: the whole column groups in a parallel loop, each unpacked
    once (_group_on_bytes); a last partial column group on the kind's own tile."""
    T, D = xu.shape
    n_blocks = wt.w.shape[0]
    col_groups = n_blocks // COLS
    xt, xs = _tile_inputs(wt, xu, sx)
    xf, wf, sf, xsf = xt.ravel(), wt.w.ravel(), sx.ravel(), xs.ravel()
    for g in prange(col_groups):
        scratch = np.empty(COLS * _unpacked_bytes(wt), np.uint8)
        acc = np.empty(ROWS * COLS * BLOCK, np.float32)
        _group_on_bytes(wt, g * COLS, scratch, xf, wf, sx, xs, sf, xsf, out, accumulate, T, D, acc)
    if n_blocks > col_groups * COLS:                        # the last blocks, every row
        acc = np.empty(ROWS * COLS * BLOCK, np.float32)
        for r0 in range(0, T, ROWS):
            _tile(wt, wf, xf, sx, xs, out, accumulate, D, r0, min(ROWS, T - r0), col_groups * COLS,
                  n_blocks - col_groups * COLS, acc)


def _groups_as_bytes(wt, xf, wf, sx, xs, out, accumulate, T, D, b_lo, b_hi, acc):
    pass


@overload(_groups_as_bytes, inline="always")
def _groups_as_bytes_of_kind(wt, xf, wf, sx, xs, out, accumulate, T, D, b_lo, b_hi, acc):
    """matmul_blocks' whole column groups from b_lo on, for 5- and 6-bit kinds at UNPACK_ROWS rows or more (a decode
    step's thread at batch 16 to 31): each group on _group_on_bytes, as _as_bytes runs a parallel matmul's (the
    same bits). Returns the first block left to the caller (a last partial group; every kind else: b_lo, nothing
    done here)."""
    kind = _kind(wt)
    if not (kind is Q5A8Weights or kind is S5A8Weights or kind is Q6A8Weights):
        return lambda wt, xf, wf, sx, xs, out, accumulate, T, D, b_lo, b_hi, acc: b_lo

    def impl(wt, xf, wf, sx, xs, out, accumulate, T, D, b_lo, b_hi, acc):
        if T < UNPACK_ROWS:
            return b_lo
        sf, xsf = sx.ravel(), xs.ravel()
        scratch = np.empty(COLS * _unpacked_bytes(wt), np.uint8)
        b0 = b_lo
        while b0 + COLS <= b_hi:
            _group_on_bytes(wt, b0, scratch, xf, wf, sx, xs, sf, xsf, out, accumulate, T, D, acc)
            b0 += COLS
        return b0
    return impl


def _matmul_int8_of(wt, xu, sx, out, accumulate):
    pass


@overload(_matmul_int8_of, inline="always")
def _matmul_int8_of_kind(wt, xu, sx, out, accumulate):
    kind = _kind(wt)
    if kind is Q5A8Weights or kind is S5A8Weights or kind is Q6A8Weights:
        def impl(wt, xu, sx, out, accumulate):
            if xu.shape[0] >= UNPACK_ROWS:
                _as_bytes(wt, xu, sx, out, accumulate)
            else:
                matmul_items(wt, xu, sx, out, accumulate)
        return impl
    return lambda wt, xu, sx, out, accumulate: matmul_items(wt, xu, sx, out, accumulate)


def pairs_share_weights(wt):
    """Whether two rows of one tile form each of wt's weights once for both (forms_weights_once_for_two_rows), so a
    second row costs less than the first."""
    raise NotImplementedError("called from Numba-compiled code only")


@overload(pairs_share_weights, inline="always")
def _pairs_share_weights_of_kind(wt):
    kind = _kind(wt)
    shares = kind in TILE_KINDS and forms_weights_once_for_two_rows(TILE_KINDS[kind][2])
    return lambda wt: shares


def column_blocks(wt, b_lo, b_hi):
    pass


@overload(column_blocks, inline="always")
def _column_blocks_of_kind(wt, b_lo, b_hi):
    """Output blocks b_lo .. b_hi of a packed matrix, as a matrix of the same kind (a view: its packs are rows of w,
    and the per-output scales of W8A8/W8A32 are cut alike). Each block's tile adds what it adds on the whole matrix."""
    kind = _kind(wt)
    if kind is W8A8Weights or kind is W8A32Weights:
        return lambda wt, b_lo, b_hi: kind(wt.w[b_lo:b_hi], wt.blocks, wt.scale[b_lo * BLOCK:b_hi * BLOCK])
    return lambda wt, b_lo, b_hi: kind(wt.w[b_lo:b_hi], wt.blocks, wt.scale)


@njit(cache=True, parallel=True)
def _matmul_int8(wt, xu, sx, out, accumulate):
    """The int8-activation matmul of layer.py's kernels, W8A8 or W4A8 by the weights' kind (5-bit kinds at many rows
    on bytes unpacked once, Q6_K too: _as_bytes)."""
    _matmul_int8_of(wt, xu, sx, out, accumulate)
