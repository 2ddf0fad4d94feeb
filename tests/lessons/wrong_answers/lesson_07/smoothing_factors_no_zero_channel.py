"""smoothing_factors without the zero-channel case: a channel whose activations (or weights) are all zero gets
s = 0 or inf, and dividing the norm weight by it gives NaN or inf downstream."""
import numpy as np

CAUGHT_BY = "smoothing_factors"


def smoothing_factors(x_amax, w_amax, alpha=0.5):
    with np.errstate(divide="ignore", invalid="ignore"):
        s = x_amax.astype(np.float64) ** alpha / w_amax.astype(np.float64) ** (1 - alpha)
    return s.astype(np.float32)
