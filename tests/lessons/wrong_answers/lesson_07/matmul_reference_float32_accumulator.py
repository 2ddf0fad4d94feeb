"""matmul_reference (w8a8) sums the int8 products in a float32 matmul: exact only below 2^24, and D * 127 * 127
reaches 24.8 M for SmolLM2's down projection, so large sums lose their last bits."""
import numpy as np

from tinyserve.quant import matmul_reference as _reference, quantize_rows

CAUGHT_BY = "matmul_reference"


def matmul_reference(x, q):
    if q.mode != "w8a8":
        return _reference(x, q)
    xq, sx = quantize_rows(x)
    acc = xq.astype(np.float32) @ q.wq.astype(np.float32)
    return acc * sx[:, None] * q.scale
