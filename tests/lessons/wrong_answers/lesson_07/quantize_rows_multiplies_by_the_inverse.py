"""quantize_rows multiplies by 127 / amax instead of dividing by sx = amax / 127: the same number on paper, another
float32 rounding, so a value just below a tie lands on the other step than the kernel's x / sx."""
import numpy as np

CAUGHT_BY = "quantize_rows"


def quantize_rows(x):
    amax = np.abs(x).max(axis=1)
    sx = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), np.float32(1)).astype(np.float32)
    return np.clip(np.floor(x * inv[:, None] + np.float32(0.5)), -127, 127).astype(np.int8), sx
