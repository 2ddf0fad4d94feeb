"""quantize_weight rounds halves away from zero (sign(v) * floor(|v| + 0.5), C's round()): 2.5 -> 3 and -2.5 -> -3
where np.rint gives 2 and -2."""
import numpy as np

from tinyserve.quant import QuantizedLinear

CAUGHT_BY = "quantize_weight"


def quantize_weight(w, mode="int8"):
    amax = np.abs(w).max(axis=0)
    scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    v = w / scale
    wq = np.clip(np.sign(v) * np.floor(np.abs(v) + np.float32(0.5)), -127, 127).astype(np.int8)
    return QuantizedLinear(np.ascontiguousarray(wq), scale, mode)
