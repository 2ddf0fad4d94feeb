"""matmul_reference (w8a8) applies the weight scale before the row scale, (float32(acc) * scale) * sx: float32
multiplication is not associative, so a few outputs differ in their last bit from the kernels'."""
import numpy as np

from tinyserve.quant import matmul_reference as _reference, quantize_rows

CAUGHT_BY = "matmul_reference"


def matmul_reference(x, q):
    if q.mode != "w8a8":
        return _reference(x, q)
    xq, sx = quantize_rows(x)
    acc = xq.astype(np.int64) @ q.wq.astype(np.int64)
    return acc.astype(np.float32) * q.scale * sx[:, None]
