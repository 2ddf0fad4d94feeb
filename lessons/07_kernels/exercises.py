"""Lesson 7 exercises: int8 quantisation (weights per output channel, activations per row), the int8 matmul it
defines, the VNNI weight layout, an int8 matmul in Numba with int32 accumulation (notebook 7a), attention over paged
KV blocks with an online softmax (7a, FlashAttention's rule), and SmoothQuant's factors (7b).

Replace each `raise NotImplementedError(...)`, then run `make check-7`: it runs tests/lessons/test_lesson_07.py
against this file and tells you, exercise by exercise, what passes. The reference answers are in
tinyserve/quant.py (quantize_weight, quantize_rows, matmul_reference, smoothing_factors) and
tinyserve/kernels/matmul.py (pack_vnni, matmul_w8a8), tinyserve/online_attention.py (online_attention): try first,
compare after.

Conventions (as in tinyserve): a weight matrix is [D, O] (y = x @ W); int8 values live in [-127, 127] (-128 is
never used, so the range is symmetric); a scale of 0 would divide by zero, so an all-zero column or row gets scale 1.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange  # noqa: F401  (for matmul_w8a8)

from tinyserve.quant import QuantizedLinear  # noqa: F401  (what quantize_weight returns)

BLOCK = 16   # output channels per packed block (one 512-bit vector of 16 int32 accumulators)


def quantize_weight(w: np.ndarray, mode: str = "int8") -> QuantizedLinear:
    """[D, O] float32 -> QuantizedLinear(wq [D, O] int8 C-contiguous, scale [O] float32, mode).

    Symmetric, one scale per output channel (column o): scale[o] = max_i |w[i, o]| / 127 (1 for an all-zero
    column), wq = round-half-to-even(w / scale) clipped to [-127, 127] (np.rint). `w` may be a transposed view
    (the tied LM head is embed.T): make wq contiguous. `mode` ("int8" or "w8a8") is stored as given.
    """
    raise NotImplementedError(
        "quantize_weight: one scale per output channel: along which axis of [D, O] do you take the maximum? "
        "What must an all-zero column's scale be so that nothing divides by zero? Which NumPy rounding is "
        "half-to-even, which dtype do the scales keep, and what does a transposed view need before it is "
        "handed to a kernel?")


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Dynamic per-row (per-token) activation quantisation: x [T, D] float32 -> (xq [T, D] int8, sx [T] float32).

    sx[t] = max_i |x[t, i]| / 127 (1 for an all-zero row), xq = floor(x / sx + 0.5) clipped to [-127, 127]:
    rounding half *up*, all in float32, exactly as the Numba kernels do it (they must produce the same int8
    values bit for bit, and np.rint rounds half to even).
    """
    raise NotImplementedError(
        "quantize_rows: the same idea as quantize_weight, one scale per row instead of per column. The kernel "
        "rounds halves up: what does np.rint do with 2.5, and how do you round half up with floor? Which "
        "operations would silently promote float32 to float64 (and so change a value the kernel computes)?")


def matmul_reference(x: np.ndarray, q: QuantizedLinear) -> np.ndarray:
    """x [T, D] float32 @ q -> [T, O] float32: the definition the kernels are tested against.

    q.mode == "int8" (W8A32): (x @ float32(q.wq)) * q.scale.
    q.mode == "w8a8": xq, sx = quantize_rows(x); acc = xq @ q.wq computed *exactly* as integers (int32 result:
    a float32 accumulator is exact only up to 2^24 = 16.7 M, and D * 127 * 127 reaches 24.8 M for D = 1536);
    then float32(acc) * sx[:, None] * q.scale, in that order.
    """
    raise NotImplementedError(
        "matmul_reference: W8A32 is a float matmul with the scale applied after. For W8A8 the integer sum must be "
        "exact: what does int8 @ int8 overflow to in NumPy, and up to which integer is a float32 sum exact? Which "
        "dtype can hold every partial sum exactly? Then apply the two scales in the order the docstring gives")


def pack_vnni(wq: np.ndarray) -> np.ndarray:
    """[D, O] int8 -> [O/16, D/4 * 64] int8, the layout of one vpdpbusd operand per 64 bytes.

    Block b holds outputs 16b .. 16b+15; within it, step i (inputs 4i .. 4i+3) is 64 bytes, output-major:
        packed[b, 64*i + 4*l + k] = wq[4*i + k, 16*b + l]        (l < 16 outputs, k < 4 inputs)
    Raise ValueError (with a sentence) unless D % 4 == 0 and O % 16 == 0.
    """
    raise NotImplementedError(
        "pack_vnni: the formula names four indices: i, k on the input side (d = 4i + k) and b, l on the output side "
        "(o = 16b + l). Can a reshape of wq give you those four as axes, and in which order must they then stand "
        "so that a flat row of block b reads 64 bytes per step i? Which shapes cannot be cut this way?")


def matmul_w8a8(xu: np.ndarray, sx: np.ndarray, wp: np.ndarray, wsum: np.ndarray, sw: np.ndarray,
                out: np.ndarray | None = None, accumulate: bool = False) -> np.ndarray:
    """The W8A8 matmul in Numba: y [T, O] float32, bit-identical to matmul_reference for mode "w8a8".

    xu [T, D] uint8: the int8 activations plus 128 (what vpdpbusd wants: unsigned x signed bytes), sx [T] their
    row scales; wp = pack_vnni(wq) [O/16, D/4*64] int8; wsum [O] int32 = wq.sum(axis=0); sw [O] the weight
    scales. For every row t and output o = 16b + l:
        acc = sum_i xu[t, i] * wq[i, o]          (int32: read wq[i, o] from wp with the pack_vnni formula)
        y[t, o] = float32(acc - 128 * wsum[o]) * sx[t] * sw[o]       (undoes the +128 exactly, in integers)
    With accumulate=True add y into `out` (the residual stream) instead of overwriting it. Allocate `out`
    ([T, O] float32) when it is None; return it.

    Write the loops in an @njit(parallel=True) function (prange over output blocks) and call it from here. Keep
    the accumulator int32: `acc += np.int32(a) * np.int32(b)` alone is widened to int64 by Numba (2-3x slower;
    docs/performance.md, "Traps"): write `acc = np.int32(acc + np.int32(a) * np.int32(b))`.
    """
    raise NotImplementedError(
        "matmul_w8a8: which loop is independent across threads (so it can be the prange), and where in wp does "
        "wq[i, o] live (invert pack_vnni's formula)? Keep the sum in int32 as the docstring says, and check the "
        "epilogue: why is 128 * wsum[o] subtracted, and why before converting to float? What does accumulate "
        "change about the write to out?")


def smoothing_factors(x_amax: np.ndarray, w_amax: np.ndarray, alpha: float = 0.5) -> np.ndarray:
    """SmoothQuant's per-input-channel factors s [D] float32 (notebook 7b, "Outliers").

    x_amax [D]: max |x[:, j]| of the activations entering a matrix (over calibration tokens); w_amax [D]: max |W[j, :]|
    over that matrix's outputs (its row j). Dividing channel j of x by s[j] and multiplying row j of W by s[j]
    leaves x @ W unchanged; the choice
        s[j] = x_amax[j] ** alpha / w_amax[j] ** (1 - alpha)
    leaves channel j spanning x_amax^(1-alpha) * w_amax^(1-alpha) in the activations and x_amax^alpha * w_amax^alpha
    in the weights: alpha moves the difficulty from one to the other. A channel where either maximum is 0 keeps
    s = 1 (there is nothing to balance, and the formula would divide by zero).
    """
    raise NotImplementedError(
        "smoothing_factors: which of the two maxima should s grow with, and which shrink it? Check your answer "
        "against the two spans in the docstring. What must come out for a channel that is all zeros?")


def online_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_table: np.ndarray,
                     context_len: int) -> np.ndarray:
    """Causal attention of one sequence's m newest rows over its paged K/V, block by block, with an online softmax.

    q [m, N, H]: the queries of positions context_len - m .. context_len - 1 (row t is position context_len - m + t
    and sees positions 0 .. context_len - m + t, itself included). k_cache, v_cache [num_blocks, bs, K, H]: the
    pool (lesson 4), already holding the new rows' K/V; position p is slot p % bs of block block_table[p // bs].
    Query head h reads K/V head h // (N // K) (lesson 3). Scores are q.k / sqrt(H). -> [m, N, H] float32.

    Walk the blocks in order and never hold a score per position of the whole context: keep per (row, head) the
    largest score so far mx, l = sum of exp(s - mx) and acc = sum of exp(s - mx) * v; per block
        mx' = max(mx, max_j s_j);  a = exp(mx - mx');  l = a * l + sum_j exp(s_j - mx');  acc = a * acc + sum_j exp(s_j - mx') v_j
    and return acc / l. Raise ValueError unless m <= context_len <= len(block_table) * bs.
    """
    raise NotImplementedError(
        "online_attention: what must mx start at so that the first block's a = exp(mx - mx') is 0? How many blocks "
        "does a context of context_len positions fill, and how many positions does the last one hold? Which "
        "positions may row t see? When a block raises the max, what happens to everything summed so far: l only, "
        "acc only, or both?")
