"""exp for float32 that LLVM can vectorise: attention's softmax and the W8A32 layer's SiLU use it.

exp(x) = 2^(x log2 e) = 2^k * 2^f with k = round(x log2 e) and |f| <= 1/2; 2^f = e^(f ln 2) by its Taylor series
to degree 6 (relative error < 2e-7, about float32's epsilon). Why not math.exp: LLVM can only call it one number at
a time (~20 ns each), and a prefill layer needs ~1 M of them in attention alone. This form is plain arithmetic that
LLVM turns into 16-wide SIMD; 2^k is built from its bits (exponent field k + 127, kernels/vnni.py's bits_float).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from .vnni import bits_float

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
