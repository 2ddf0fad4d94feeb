"""float32 loops LLVM can vectorise when written this way: exp (attention's softmax, the SiLU of the MLP) and the max
of a row (the softmax's shift). Attention's exp + sum of a chunk is kernels/key_chunks.py's chunk_softmax.

exp(x) = 2^(x log2 e) = 2^k * 2^f with k = round(x log2 e) and |f| <= 1/2; 2^f = e^(f ln 2) by its Taylor series
to degree 6 (relative error < 2e-7, about float32's epsilon). Why not math.exp: LLVM can only call it one number at
a time, and a prefill layer needs one per query row and key position in attention alone. This form is plain
arithmetic that LLVM turns into 16-wide SIMD; 2^k is built from its bits (exponent field k + 127, kernels/simd.py's
bits_float).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from .simd import bits_float, float_bits

_C = tuple(np.float32(math.log(2.0) ** i / math.factorial(i)) for i in range(7))
_LOG2E = np.float32(1.0 / math.log(2.0))


@njit(cache=True, inline="always")
def exp32(x):
    """e^x for a float32 x, within 2e-7 relative. Clamped to [2^-126, 2^127.5]: below e^-87 float32 has no normal
    numbers (the result is ~1e-38 instead of smaller), above e^88 it overflows (the result stays finite)."""
    c0, c1, c2, c3, c4, c5, c6 = _C
    t = min(max(x * _LOG2E, np.float32(-126.0)), np.float32(127.0))
    k = np.floor(t + np.float32(0.5))
    f = t - k
    return (c0 + f * (c1 + f * (c2 + f * (c3 + f * (c4 + f * (c5 + f * c6)))))) * bits_float((np.int32(k) + 127) << 23)


# The max of a row, m = max(m, x[i]), stays scalar as a float loop: a NaN could sit in any lane, so LLVM will not
# reorder the compares into 16 lanes (lesson 7's trap 5). Over int32 it does. A float32's bits read as
# an int32, with the negative ones flipped, sort exactly like the floats: take the max over those.

@njit(cache=True, inline="always")
def ordered(b):
    """A float32's bits (int32) -> an int32 in the same order as the floats (negative floats count down), and back
    (the map is its own inverse)."""
    return b ^ ((b >> 31) & np.int32(0x7FFFFFFF))


@njit(cache=True, inline="always")
def row_max(x, n):
    """max(x[:n]) for n >= 1 float32 (no NaN), 16 lanes wide."""
    top = np.int32(-2147483647)
    for j in range(n):
        top = max(top, ordered(float_bits(x[j])))
    return bits_float(ordered(top))
