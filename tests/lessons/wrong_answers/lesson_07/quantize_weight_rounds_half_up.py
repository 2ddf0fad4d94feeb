"""quantize_weight rounds with floor(w / scale + 0.5), as quantize_rows does: halves go up where np.rint takes them
to the even neighbour, so 2.5 -> 3 (rint: 2) and -3.5 -> -3 (rint: -4): one step off at every other tie."""
import numpy as np

from tinyserve.quant import QuantizedLinear

CAUGHT_BY = "quantize_weight"


def quantize_weight(w, mode="int8"):
    amax = np.abs(w).max(axis=0)
    scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    wq = np.clip(np.floor(w / scale + np.float32(0.5)), -127, 127).astype(np.int8)
    return QuantizedLinear(np.ascontiguousarray(wq), scale, mode)
