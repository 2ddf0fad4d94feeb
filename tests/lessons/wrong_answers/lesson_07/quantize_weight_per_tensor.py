"""quantize_weight with one scale for the whole matrix (per tensor), broadcast to every column: every value still
round-trips within half a step, but of the largest column's step, not its own."""
import numpy as np

from tinyserve.quant import QuantizedLinear

CAUGHT_BY = "quantize_weight"


def quantize_weight(w, mode="int8"):
    amax = np.float32(np.abs(w).max())
    s = amax / np.float32(127) if amax > 0 else np.float32(1)
    scale = np.full(w.shape[1], s, np.float32)
    wq = np.ascontiguousarray(np.clip(np.rint(w / scale), -127, 127).astype(np.int8))
    return QuantizedLinear(wq, scale, mode)
