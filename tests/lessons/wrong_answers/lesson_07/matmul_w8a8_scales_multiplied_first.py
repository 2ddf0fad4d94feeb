"""matmul_w8a8 multiplies the two scales first, float32(acc - 128 wsum) * (sx[t] * sw[o]): the same product on
paper, another float32 rounding, so some outputs differ from the reference in their last bit."""
import numpy as np
from numba import njit, prange

CAUGHT_BY = "matmul_w8a8"


@njit(parallel=True, cache=False)
def _kernel(xu, sx, wp, wsum, sw, out, accumulate):
    T, D = xu.shape
    for b in prange(wp.shape[0]):
        for t in range(T):
            for l in range(16):
                acc = np.int32(0)
                for d in range(D):
                    i, k = d // 4, d % 4
                    acc = np.int32(acc + np.int32(xu[t, d]) * np.int32(wp[b, 64 * i + 4 * l + k]))
                o = 16 * b + l
                y = np.float32(acc - 128 * wsum[o]) * (sx[t] * sw[o])
                if accumulate:
                    out[t, o] += y
                else:
                    out[t, o] = y


def matmul_w8a8(xu, sx, wp, wsum, sw, out=None, accumulate=False):
    if out is None:
        out = np.empty((xu.shape[0], wp.shape[0] * 16), np.float32)
    _kernel(xu, sx, wp, wsum, sw, out, accumulate)
    return out
