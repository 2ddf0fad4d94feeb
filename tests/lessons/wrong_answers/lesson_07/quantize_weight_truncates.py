"""quantize_weight casts w / scale straight to int8: astype truncates toward zero instead of rounding, a bias of
up to a whole step."""
import numpy as np

from tinyserve.quant import QuantizedLinear

CAUGHT_BY = "quantize_weight"


def quantize_weight(w, mode="int8"):
    amax = np.abs(w).max(axis=0)
    scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    wq = np.ascontiguousarray(np.clip(w / scale, -127, 127).astype(np.int8))
    return QuantizedLinear(wq, scale, mode)
